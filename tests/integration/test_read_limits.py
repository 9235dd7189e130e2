"""The read buckets on the real Redis (issue 37 M2): exact across several gateways' clients, the org's bucket shared
by its keys, apart from the requests' bucket."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from runtime.limiter import Admitted, Limits, RateLimiter
from runtime.redis_client import make_redis
from runtime.settings import Settings

pytestmark = pytest.mark.integration


def _ids() -> tuple[str, str]:
    return f"key_{uuid.uuid4().hex[:8]}", f"org-{uuid.uuid4().hex[:8]}"


async def test_reads_per_minute_are_exact_across_three_gateways(stack: Settings) -> None:
    clients = [make_redis(stack.redis) for _ in range(3)]
    limiters = [RateLimiter(c, stack.redis) for c in clients]
    key_id, org_id = _ids()
    started = time.monotonic()
    try:
        answers = await asyncio.gather(*(limiters[i % 3].admit_read(key_id=key_id, org_id=org_id, key_reads=10,
                                                                    org_reads=1000) for i in range(60)))
    finally:
        for client in clients:
            await client.aclose()
    assert time.monotonic() - started < 6  # 10 a minute refill one every 6 s: within it, exactly the bucket
    admitted = [a for a in answers if a.admitted]
    refused = [a for a in answers if not a.admitted]
    assert len(admitted) == 10 and len(refused) == 50
    assert sorted(a.window.remaining for a in admitted) == list(range(10))
    assert {(r.scope, r.value) for r in refused} == {("key", 10)}
    assert all(0 < r.retry_after_ms <= 6000 and r.window.headers()["x-ratelimit-limit-requests"] == "10"
               for r in refused)


async def test_an_orgs_keys_share_its_read_bucket_and_its_requests_are_untouched(stack: Settings) -> None:
    redis = make_redis(stack.redis)
    limiter = RateLimiter(redis, stack.redis, lease_s=60, reservation_ttl_s=600)
    (first, org_id), (second, _) = _ids(), _ids()
    try:
        answers = [await limiter.admit_read(key_id=key, org_id=org_id, key_reads=100, org_reads=3)
                   for key in (first, second, first, second)]
        assert [a.admitted for a in answers] == [True, True, True, False]
        assert (answers[3].scope, answers[3].value) == ("org", 3)
        limits = Limits(requests_per_minute=1, tokens_per_minute=100, max_concurrent=1)
        admitted = await limiter.admit(f"r-{uuid.uuid4().hex}", 1, key_id=first, org_id=org_id, key_limits=limits,
                                       org_limits=limits)
        assert isinstance(admitted, Admitted)  # the reads took nothing from the requests' bucket
    finally:
        await redis.aclose()


async def test_a_read_that_costs_several_takes_them_all_or_none(stack: Settings) -> None:
    redis = make_redis(stack.redis)
    limiter = RateLimiter(redis, stack.redis)
    key_id, org_id = _ids()
    try:
        answers = [await limiter.admit_read(key_id=key_id, org_id=org_id, key_reads=10, org_reads=1000, cost=4)
                   for _ in range(3)]
        single = await limiter.admit_read(key_id=key_id, org_id=org_id, key_reads=10, org_reads=1000)
    finally:
        await redis.aclose()
    assert [a.admitted for a in answers] == [True, True, False]
    assert [a.window.remaining for a in answers[:2]] == [6, 2]
    # refused for the 2 reads it lacked (one each 6 s), and took nothing: a read of one still finds its 2
    assert (answers[2].scope, 11_000 < answers[2].retry_after_ms <= 12_000) == ("key", True)
    assert single.admitted and single.window.remaining == 1
