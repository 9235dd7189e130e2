"""Crash-proof streams (issue 10): a stream outlives its gateway.

A client whose gateway was SIGKILLed, or stopped, reconnects to another gateway with the last event id it
received and gets the rest of its stream, including what was generated while nobody listened, each token once,
the text identical to an uninterrupted run. Ids that are forged, another org's or past the resume window: 404.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import httpx
import orjson
import pytest

from runtime.settings import Settings
from tests.conftest import GATEWAY_PORT, SESSION, WORKER_ADMIN_PORT, Caller
from tests.e2e.conftest import MODEL, gateway_process
from tests.helpers import ServiceProcess, wait_for

pytestmark = pytest.mark.e2e

DOOMED_PORT = GATEWAY_PORT + 7
#: long enough to kill its gateway mid-stream on 2 cores; ignore_eos keeps the length fixed at temperature 0
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}],
        "temperature": 0, "max_tokens": 160, "ignore_eos": True, "stream": True}


@dataclass
class Received:
    text: str = ""
    ids: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    done: bool = False
    errors: list[dict] = field(default_factory=list)  # type: ignore[type-arg]

    @property
    def last_id(self) -> str:
        return self.ids[-1]

    def positions(self) -> list[int]:
        return [int(i.rpartition(":")[2]) for i in self.ids]


@pytest.fixture()
def doomed(gateway: ServiceProcess, service_env: dict[str, str]) -> Iterator[ServiceProcess]:
    """A gateway of its own, for the test to kill or stop (the session's gateway is where clients resume)."""
    proc = gateway_process(DOOMED_PORT, service_env)
    proc.start()
    try:
        proc.wait_healthy(120)
        yield proc
    finally:
        proc.stop()


async def events(response: httpx.Response) -> AsyncIterator[tuple[str | None, str]]:
    """(id, data) of each server-sent event."""
    event_id, data = None, []
    async for line in response.aiter_lines():
        if line.startswith("id: "):
            event_id = line[4:]
        elif line.startswith("data: "):
            data.append(line[6:])
        elif not line and data:
            yield event_id, "\n".join(data)
            event_id, data = None, []


async def read(response: httpx.Response | AsyncIterator[tuple[str | None, str]], into: Received, *,
               stop_after: int | None = None) -> Received:
    """Reads events into ``into`` (to ``[DONE]``, the end, or ``stop_after`` content events). Pass ``events(r)``
    to go on reading the same response later."""
    import orjson

    source = events(response) if isinstance(response, httpx.Response) else response
    async for event_id, data in source:
        if data == "[DONE]":
            into.done = True
            break
        body = orjson.loads(data)
        assert event_id is not None, f"an event without id: {data}"
        into.ids.append(event_id)
        if "error" in body:
            into.errors.append(body["error"])
            continue
        for choice in body.get("choices", ()):
            into.text += choice["delta"].get("content") or ""
            into.finish_reason = choice.get("finish_reason") or into.finish_reason
        if stop_after is not None and sum(1 for i in into.ids if not i.endswith(":0")) >= stop_after:
            break
    return into


async def uninterrupted(http: httpx.AsyncClient, caller: Caller) -> Received:
    async with http.stream("POST", f"http://127.0.0.1:{GATEWAY_PORT}/v1/chat/completions", json=BODY,
                           headers={"Authorization": f"Bearer {caller.secret}"}) as response:
        assert response.status_code == 200
        return await read(response, Received())


async def resume(http: httpx.AsyncClient, caller: Caller, last_id: str, port: int = GATEWAY_PORT) -> Received:
    async with http.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=BODY,
                           headers={"Authorization": f"Bearer {caller.secret}", "Last-Event-ID": last_id}
                           ) as response:
        assert response.status_code == 200, (await response.aread()).decode()
        return await read(response, Received())


async def test_a_stream_resumes_on_another_gateway_after_its_gateway_is_killed(doomed: ServiceProcess,
                                                                               caller: Caller) -> None:
    async with httpx.AsyncClient(timeout=120) as http:
        reference = await uninterrupted(http, caller)
        assert reference.finish_reason == "length" and reference.done
        before = Received()
        async with http.stream("POST", f"http://127.0.0.1:{DOOMED_PORT}/v1/chat/completions", json=BODY,
                               headers={"Authorization": f"Bearer {caller.secret}"}) as response:
            await read(response, before, stop_after=5)
            doomed.kill()  # SIGKILL mid-stream: no clean-up, its reply partition's relay gone
        # Longer than the gateway's liveness TTL: the worker sees it gone and goes on, for nobody, meanwhile.
        await asyncio.sleep(6)
        after = await resume(http, caller, before.last_id)
    assert not after.errors and after.done and after.finish_reason == "length"
    assert before.text + after.text == reference.text  # each token once, in order, nothing missing
    positions = before.positions() + after.positions()
    assert positions == sorted(positions) and len(set(positions)) == len(positions)
    assert after.ids[0].rpartition(":")[0] == before.last_id.rpartition(":")[0]


async def test_a_stopping_gateway_hands_its_streams_over_and_they_finish_elsewhere(doomed: ServiceProcess,
                                                                                   caller: Caller) -> None:
    async with httpx.AsyncClient(timeout=120) as http:
        reference = await uninterrupted(http, caller)
        before = Received()
        async with http.stream("POST", f"http://127.0.0.1:{DOOMED_PORT}/v1/chat/completions", json=BODY,
                               headers={"Authorization": f"Bearer {caller.secret}"}) as response:
            stream = events(response)
            await read(stream, before, stop_after=3)
            started = time.monotonic()
            stopping = asyncio.ensure_future(asyncio.to_thread(doomed.stop))
            with pytest.raises(httpx.HTTPError):  # closed without [DONE]: the signal to reconnect
                await read(stream, before)
        assert not before.done
        handed_over_s = time.monotonic() - started
        after = await resume(http, caller, before.last_id)
        assert await stopping == 0
    assert handed_over_s < 5, f"the stream was handed over after {handed_over_s:.1f} s"
    assert not after.errors and after.done and after.finish_reason == "length"
    assert before.text + after.text == reference.text


@pytest.mark.timeout(300)  # a gateway of its own starts, up to 120 s
async def test_forged_foreign_and_expired_ids_get_404_and_a_finished_stream_replays(
        gateway: ServiceProcess, service_env: dict[str, str], caller: Caller, make_caller) -> None:  # type: ignore[no-untyped-def]
    other_org = make_caller(org=f"org-resume-other-{SESSION}")
    short = gateway_process(DOOMED_PORT, service_env, KNS_GATEWAY__RESUME_TTL_S="3",
                            KNS_GATEWAY__RESUME_WINDOW_S="2")  # a window shorter than the TTL, as validated
    short.start()
    try:
        short.wait_healthy(120)
        async with httpx.AsyncClient(timeout=120) as http:
            small = {**BODY, "max_tokens": 8}
            async with http.stream("POST", f"http://127.0.0.1:{DOOMED_PORT}/v1/chat/completions", json=small,
                                   headers={"Authorization": f"Bearer {caller.secret}"}) as response:
                expiring = await read(response, Received())
            finished = await uninterrupted(http, caller)
            request_id = finished.last_id.rpartition(":")[0]

            async def status(secret: str, last_id: str) -> tuple[int, dict]:  # type: ignore[type-arg]
                answer = await http.post(f"http://127.0.0.1:{GATEWAY_PORT}/v1/chat/completions", json=BODY,
                                         headers={"Authorization": f"Bearer {secret}", "Last-Event-ID": last_id})
                return answer.status_code, answer.json()

            forged = await status(caller.secret, "chatcmpl-00000000000000000000000000000000:3")
            foreign = await status(other_org.secret, f"{request_id}:3")
            malformed = await status(caller.secret, "not an event id")
            await asyncio.sleep(4)
            expired = await status(caller.secret, expiring.ids[1])
            # The owner replays a finished stream from the start (GET, as an EventSource would).
            async with http.stream("GET", f"http://127.0.0.1:{GATEWAY_PORT}/v1/chat/completions/{request_id}",
                                   params={"stream": "true"},
                                   headers={"Authorization": f"Bearer {caller.secret}"}) as response:
                replay = await read(response, Received())
    finally:
        short.stop()
    for code, body in (forged, foreign, expired):
        assert code == 404 and body["error"]["code"] == "not_found", body
    assert foreign[1]["error"]["message"] == forged[1]["error"]["message"].replace(
        "chatcmpl-00000000000000000000000000000000", request_id)  # says nothing about whose it is
    assert malformed[0] == 400 and malformed[1]["error"]["param"] == "Last-Event-ID"
    assert replay.text == finished.text and replay.done and replay.ids[-1] == finished.ids[-1]


def _generating_for(instance: str) -> bool:
    """Whether the worker generates a request of that gateway instance (its id is the instance's and a suffix of
    the process's) and has emitted a token of it."""
    jobs = httpx.get(f"http://127.0.0.1:{WORKER_ADMIN_PORT}/state", timeout=5).json()["in_flight"]
    return any(j["gateway"].startswith(f"{instance}/") and j["tokens"] > 0 for j in jobs)


async def test_a_stored_completion_is_fetched_by_id_after_its_gateway_died(doomed: ServiceProcess, base_url: str,
                                                                           caller: Caller, stack: Settings,
                                                                           worker: ServiceProcess) -> None:
    """The gateway dies with the request accepted and generating (its first token is in the log), before it could
    answer: the worker is frozen (SIGSTOP) from that token until the gateway is dead, so a fast engine cannot
    finish first."""
    import openai

    tag = f"resume-{time.time_ns()}"
    body = {**BODY, "stream": False, "store": True, "max_tokens": 64, "metadata": {"client_request": tag}}
    async with httpx.AsyncClient(timeout=120) as http:
        reference = (await http.post(f"{base_url}/chat/completions", json={**body, "store": False, "metadata": None},
                                     headers={"Authorization": f"Bearer {caller.secret}"})).json()
        asking = asyncio.ensure_future(http.post(f"http://127.0.0.1:{DOOMED_PORT}/v1/chat/completions", json=body,
                                                 headers={"Authorization": f"Bearer {caller.secret}"}))
        # Seen generating in the worker's own state (a read of the token log takes seconds late in a session, by
        # which time a 64-token answer has been delivered)
        await wait_for(lambda: _generating_for(f"test-gateway-{DOOMED_PORT}-{SESSION}"), timeout_s=60,
                       interval_s=0.02, what="the request generating")
        os.killpg(worker.proc.pid, signal.SIGSTOP)  # type: ignore[union-attr]
        try:
            doomed.kill()  # the gateway dies before it can answer
        finally:
            os.killpg(worker.proc.pid, signal.SIGCONT)  # type: ignore[union-attr]
        with pytest.raises(httpx.HTTPError):
            await asking
    # The dead gateway never answered, so the client has no id: it finds its completion by the metadata it sent.
    async with openai.AsyncOpenAI(base_url=base_url, api_key=caller.secret, max_retries=0) as client:

        async def listed() -> list[object]:
            return list((await client.chat.completions.list(metadata={"client_request": tag})).data)

        found = await wait_for(listed, timeout_s=60, interval_s=0.5)
        got = await client.chat.completions.retrieve(found[0].id)  # type: ignore[attr-defined]
    assert got.choices[0].message.content == reference["choices"][0]["message"]["content"]
    assert got.choices[0].finish_reason == "length"


async def test_a_stream_without_event_ids_is_read_by_a_one_data_line_parser_and_replays_with_ids(
        gateway: ServiceProcess, caller: Caller) -> None:
    """``kns-event-ids: off``: OpenAI's bytes (what vLLM's benchmark client can parse), and the stream is still
    replayed, with ids, from its start."""
    from vllm.benchmarks.lib.endpoint_request_func import StreamedResponseHandler

    small = {**BODY, "max_tokens": 12}
    url = f"http://127.0.0.1:{GATEWAY_PORT}/v1/chat/completions"
    auth = {"Authorization": f"Bearer {caller.secret}"}
    async with httpx.AsyncClient(timeout=120) as http:
        async with http.stream("POST", url, json=small, headers={**auth, "kns-event-ids": "off"}) as response:
            assert response.status_code == 200
            raw = await response.aread()
        async with http.stream("POST", url, json=small, headers=auth) as response:
            with_ids = await read(response, Received())
        bad = await http.post(url, json=small, headers={**auth, "kns-event-ids": "sometimes"})
        request_id = orjson.loads(raw.split(b"\n", 1)[0][6:])["id"]
        async with http.stream("GET", f"{url}/{request_id}", params={"stream": "true"}, headers=auth) as response:
            replay = await read(response, Received())
    assert b"\nid: " not in raw and not raw.startswith(b"id: ")
    handler = StreamedResponseHandler()
    messages = [m.removeprefix("data: ") for m in handler.add_chunk(raw)]
    assert messages[-1] == "[DONE]"
    chunks = [orjson.loads(m) for m in messages[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == with_ids.text and text  # temperature 0: the same answer
    assert replay.text == text and replay.done and replay.ids[0] == f"{request_id}:0"
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "kns-event-ids"
