"""Billing is exact: 200 requests, the billing processor SIGKILLed and restarted mid-way, ledger == engine usage,
each request once in the ledger's views, its hourly aggregates and the org's spend. Then reconcile finds a
hand-corrupted row and --repair fixes it."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import openai
import pytest

from billing.ledger import Ledger
from runtime.cassandra_client import connect_async, execute
from runtime.redis_client import make_redis
from runtime.settings import Settings
from runtime.spend import SpendBook, ledger_nanos, month_of
from tests.conftest import SESSION
from tests.e2e.conftest import MODEL, kns
from tests.helpers import ServiceProcess, wait_for

pytestmark = pytest.mark.e2e
REQUESTS = 200


@pytest.mark.timeout(600)  # 200 completions, a billing crash and restart (up to 180 s), three CLI runs
async def test_the_ledger_survives_a_billing_crash_exactly(base_url: str, make_caller, stack: Settings,  # type: ignore[no-untyped-def]
                                                           processors: dict[str, ServiceProcess],
                                                           service_env: dict[str, str]) -> None:
    org = f"org-bill-{SESSION}"
    caller = make_caller(org=org)
    started = datetime.now(UTC) - timedelta(seconds=5)
    cluster, session = await connect_async(stack.cassandra)
    ledger = await Ledger.open(session, stack.cassandra.keyspace)

    async def billed() -> int:
        return len(await ledger.rows_for_org(org, started, datetime.now(UTC) + timedelta(minutes=5)))

    async def billed_at_least(n: int) -> bool:
        return await billed() >= n

    usage: dict[str, openai.types.CompletionUsage] = {}
    async with openai.AsyncOpenAI(base_url=base_url, api_key=caller.secret, max_retries=0, timeout=300) as client:
        semaphore = asyncio.Semaphore(16)

        async def one(i: int) -> None:
            async with semaphore:
                r = await client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": f"Count to {i % 7 + 1}."}],
                    max_tokens=i % 4 + 1, temperature=0)
                usage[r.id] = r.usage

        requests = asyncio.gather(*(one(i) for i in range(REQUESTS)))
        # Kill the billing processor once part of the traffic is billed, and bring it back.
        assert await wait_for(lambda: billed_at_least(30), timeout_s=240)
        killed_at = await billed()
        processors["billing"].kill()
        await asyncio.sleep(2)
        processors["billing"].start()
        await asyncio.to_thread(processors["billing"].wait_healthy, 180)
        await requests

    assert killed_at < REQUESTS, "the processor must be killed in the middle"
    assert await wait_for(lambda: billed_at_least(REQUESTS), timeout_s=180), f"only {await billed()} billed"
    listed = await ledger.rows_for_org(org, started, datetime.now(UTC) + timedelta(minutes=5))
    rows = {r["request_id"]: r for r in listed}
    assert set(rows) == set(usage)  # no loss
    assert len(listed) == REQUESTS, f"{len(listed)} rows in the org's day view for {REQUESTS} requests"  # no double
    # The aggregates and the org's spend count each request once too (a redelivery after the crash must not add).
    prompt, completion = (sum(getattr(u, f) for u in usage.values()) for f in ("prompt_tokens", "completion_tokens"))

    async def hourly_adds_up() -> bool:
        hours = [h for day in {r["requested_at"].date() for r in listed} for h in await ledger.hourly(org, day)]
        totals = [sum(h[f] for h in hours) for f in ("requests", "prompt_tokens", "completion_tokens")]
        return totals == [REQUESTS, prompt, completion]

    await wait_for(hourly_adds_up, timeout_s=60,
                   what=f"usage_hourly adds up to {REQUESTS} requests, {prompt} + {completion} tokens")
    redis = make_redis(stack.redis)
    try:
        spend = await SpendBook(redis, stack.redis).read(org, month_of(started))
    finally:
        await redis.aclose()
    assert spend.billed_nanos == ledger_nanos(r["cost"] for r in listed), "the spend counts a request twice"
    for request_id, u in usage.items():
        assert (rows[request_id]["prompt_tokens"], rows[request_id]["completion_tokens"]) == (
            u.prompt_tokens, u.completion_tokens), request_id
    full = await ledger.full_rows(usage.keys())
    assert {rid: (r.prompt_tokens, r.completion_tokens) for rid, r in full.items()} == {
        rid: (u.prompt_tokens, u.completion_tokens) for rid, u in usage.items()}

    window = ["--start", started.isoformat(), "--end", (datetime.now(UTC) + timedelta(seconds=1)).isoformat(),
              "--org", org]
    clean = await asyncio.to_thread(kns, service_env, "billing", "reconcile", *window)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert "0 discrepancies" in clean.stdout

    victim = sorted(usage)[0]
    await execute(session, f"UPDATE {stack.cassandra.keyspace}.ledger_by_request SET completion_tokens = 4242 "
                           "WHERE request_id = %s", (victim,))
    found = await asyncio.to_thread(kns, service_env, "billing", "reconcile", *window)
    assert found.returncode == 1 and victim in found.stdout and "mismatched" in found.stdout
    fixed = await asyncio.to_thread(kns, service_env, "billing", "reconcile", *window, "--repair")
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert (await ledger.get(victim)).completion_tokens == usage[victim].completion_tokens
    await asyncio.to_thread(cluster.shutdown)
    print(f"billing killed with {killed_at}/{REQUESTS} billed; after restart: {len(rows)} rows, exact")
