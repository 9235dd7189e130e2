"""Rate limits across three gateway processes on one key (issue 9 item 2; LiteLLM's #18730, #27736 and #41610 as
tests): exactly N of 6N concurrent streaming requests pass an N-per-minute limit, the rest get 429 with
Retry-After; streamed requests count toward tokens per minute, the tokens admitted never exceed the limit, and
once every request has ended the limiter's settled counter equals the ledger's usage."""

from __future__ import annotations

import asyncio
import time
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import openai
import orjson
import pytest

from billing.ledger import Ledger
from producers.tenancy.admin import Limits
from runtime.cassandra_client import connect_async
from runtime.limiter import RateLimiter
from runtime.redis_client import make_redis
from runtime.settings import Settings
from tests.conftest import SESSION
from tests.e2e.conftest import MODEL
from tests.helpers import ServiceProcess, wait_for

pytestmark = pytest.mark.e2e
RATE_HEADERS = {"x-ratelimit-limit-requests", "x-ratelimit-remaining-requests", "x-ratelimit-reset-requests",
                "x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens"}


async def _stream(http: httpx.AsyncClient, port: int, secret: str, content: str, max_tokens: int
                  ) -> tuple[httpx.Response, list[str], float]:
    """One streaming request, read to its end: the response, its lines, when its headers arrived."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    async with http.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body,
                           headers={"Authorization": f"Bearer {secret}"}) as response:
        answered = time.monotonic()
        if response.status_code != 200:
            await response.aread()  # an error body, read before the stream closes
            return response, [], answered
        text = [line async for line in response.aiter_lines() if line]
    return response, text, answered


@pytest.mark.timeout(300)  # 36 streams
async def test_exactly_n_requests_per_minute_pass_across_three_gateways(
        three_gateways: tuple[int, ...], make_caller) -> None:  # type: ignore[no-untyped-def]
    n = 6  # refills one request every 10 s: the burst's admissions all fall within that (asserted below)
    # Under the abuse detector's suspension: at 6 rpm it suspends a key at 42 requests (admitted and refused) in a
    # 10 s window, six times what the bucket admits there (stream_processors/abuse/rules.py). 36 and the SDK's one
    # below stay under it, so the SDK sees the limiter's 429, not 403 key_suspended.
    burst = 36
    caller = make_caller(org=f"org-rpm-{uuid.uuid4().hex[:8]}", tier="plus",
                         limits=Limits(requests_per_minute=n, max_concurrent=1000))
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=200)) as http:
        started = time.monotonic()
        answers = await asyncio.gather(*(
            _stream(http, three_gateways[i % 3], caller.secret, f"Say {i}.", 2) for i in range(burst)))
    admitted = [(r, text) for r, text, _ in answers if r.status_code == 200]
    refused = [r for r, _, _ in answers if r.status_code != 200]
    last_admission = max(t for r, _, t in answers) - started
    assert last_admission < 60 / n, f"the burst took {last_admission:.1f} s: a refill could have let one more in"
    assert len(admitted) == n, f"{len(admitted)} admitted of {burst} at {n} per minute"
    assert {r.status_code for r in refused} == {429}
    for response in refused:
        error = response.json()["error"]
        assert (error["code"], error["type"]) == ("rate_limit_exceeded", "requests"), error
        assert 1 <= int(response.headers["retry-after"]) <= 60 / n
        assert set(response.headers) >= RATE_HEADERS
    for response, text in admitted:  # streamed answers carry the headers too, and stream to their end
        assert set(response.headers) >= RATE_HEADERS and response.headers["x-ratelimit-limit-requests"] == str(n)
        assert text[-1] == "data: [DONE]"
    assert sorted(int(r.headers["x-ratelimit-remaining-requests"]) for r, _ in admitted) == list(range(n))
    # The official SDK sees OpenAI's error (no retries here: it would honour retry-after-ms and wait).
    async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{three_gateways[1]}/v1", api_key=caller.secret,
                                  max_retries=0) as client:
        with pytest.raises(openai.RateLimitError) as raised:
            await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=1)
    assert raised.value.code == "rate_limit_exceeded"


@pytest.mark.timeout(300)  # 40 streams of up to 100 tokens, then up to 90 s for the ledger
async def test_streamed_tokens_count_toward_tpm_and_the_settled_counter_equals_the_ledger(
        three_gateways: tuple[int, ...], make_caller, stack: Settings,  # type: ignore[no-untyped-def]
        processors: dict[str, ServiceProcess]) -> None:
    tpm, max_tokens = 2000, 100
    org = f"org-tpm-{SESSION}-{uuid.uuid4().hex[:6]}"
    caller = make_caller(org=org, tier="plus", limits=Limits(tokens_per_minute=tpm, requests_per_minute=10_000,
                                                             max_concurrent=1000))
    started_at = datetime.now(UTC) - timedelta(seconds=5)
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=100)) as http:
        started = time.monotonic()
        answers = await asyncio.gather(*(
            _stream(http, three_gateways[i % 3], caller.secret, f"Write a poem about the number {i}.", max_tokens)
            for i in range(40)))
    admitted = [(r, text) for r, text, _ in answers if r.status_code == 200]
    refused = [r for r, _, _ in answers if r.status_code != 200]
    elapsed = max(t for _, _, t in answers) - started
    assert admitted and refused, (len(admitted), len(refused))
    assert {(r.status_code, r.json()["error"]["type"]) for r in refused} == {(429, "tokens")}
    # Each admitted request reserved its prompt + max_tokens; together never more than the bucket held (its
    # capacity, plus what refilled while the burst was admitted).
    prompt_tokens = _prompt_tokens(admitted)
    reserved = sum(p + max_tokens for p in prompt_tokens)
    assert reserved <= tpm + tpm * elapsed / 60, (reserved, tpm, elapsed)

    redis = make_redis(stack.redis)
    limiter = RateLimiter(redis, stack.redis)
    cluster, session = await connect_async(stack.cassandra)
    ledger = await Ledger.open(session, stack.cassandra.keyspace)
    try:
        async def ledger_usage() -> int:
            rows = await ledger.rows_for_org(org, started_at, datetime.now(UTC) + timedelta(minutes=5))
            return sum(int(r["prompt_tokens"]) + int(r["completion_tokens"]) for r in rows)

        async def settled() -> int:
            return int(await redis.get(limiter.settled_key("org", org)) or 0)

        told = sum(_usage(text) for _, text in admitted)

        async def agree() -> bool:
            # Each settles after its commit, which a client's final does not wait for (its stream reads
            # uncommitted): the ledger and the counter catch up in steps, and may agree on the way.
            return await ledger_usage() == await settled() == told

        # Every streamed request counted: the settled usage is what the clients were told they used, and the
        # ledger agrees.
        assert await wait_for(agree, timeout_s=90), (await ledger_usage(), await settled(), told)
        assert int(await redis.get(limiter.settled_key("key", caller.key.key_id)) or 0) == await settled()
    finally:
        await redis.aclose()
        await asyncio.to_thread(cluster.shutdown)


def _chunks(lines: list[str]) -> list[dict[str, Any]]:
    return [orjson.loads(line[6:]) for line in lines if line.startswith("data: {")]


def _usage(text: list[str]) -> int:
    (usage,) = [c["usage"] for c in _chunks(text) if c.get("usage")]
    return int(usage["prompt_tokens"]) + int(usage["completion_tokens"])


def _prompt_tokens(admitted: list[tuple[httpx.Response, list[str]]]) -> list[int]:
    return [next(int(c["usage"]["prompt_tokens"]) for c in _chunks(text) if c.get("usage")) for _, text in admitted]
