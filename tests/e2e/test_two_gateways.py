"""Two gateway processes at once: each claims its own reply partition and both stream correctly."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.conftest import GATEWAY_PORT, SESSION, Caller
from tests.e2e.conftest import MODEL, QUESTION, gateway_process
from tests.helpers import ServiceProcess

pytestmark = pytest.mark.e2e
SECOND_PORT = GATEWAY_PORT + 1


@pytest.fixture(scope="module")
def second_gateway(gateway: ServiceProcess, service_env: dict[str, str]) -> Iterator[ServiceProcess]:
    proc = gateway_process(SECOND_PORT, service_env, f"test-gateway-b-{SESSION}")
    proc.start()
    try:
        proc.wait_healthy(120)
        yield proc
    finally:
        proc.stop()


async def test_two_gateways_have_their_own_partitions_and_both_stream(second_gateway: ServiceProcess,
                                                                      caller: Caller) -> None:
    async with httpx.AsyncClient() as http:
        health = [(await http.get(f"http://127.0.0.1:{port}/health")).json() for port in (GATEWAY_PORT, SECOND_PORT)]
    assert health[0]["reply_partition"] != health[1]["reply_partition"]

    async def ask(port: int) -> str:
        async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=caller.secret) as c:
            stream = await c.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=32,
                                                     stream=True)
            return "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])

    answers = await asyncio.gather(*(ask(port) for port in (GATEWAY_PORT, SECOND_PORT) for _ in range(3)))
    assert len(set(answers)) == 1 and "Paris" in answers[0]


def test_a_restarted_gateway_keeps_its_partition(second_gateway: ServiceProcess) -> None:
    before = httpx.get(f"http://127.0.0.1:{SECOND_PORT}/health").json()["reply_partition"]
    second_gateway.stop()
    second_gateway.start()
    second_gateway.wait_healthy(120)
    assert httpx.get(f"http://127.0.0.1:{SECOND_PORT}/health").json()["reply_partition"] == before
