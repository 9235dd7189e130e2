"""The rate limiter on the real Redis: exact across several limiter processes' clients, reservations settled once."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from runtime.limiter import Admitted, Limits, RateLimiter, Refused, duration
from runtime.redis_client import make_redis
from runtime.settings import Settings

pytestmark = pytest.mark.integration
WIDE = Limits(requests_per_minute=1_000_000, tokens_per_minute=10**12, max_concurrent=1_000_000)


def _ids() -> tuple[str, str]:
    return f"key_{uuid.uuid4().hex[:8]}", f"org-{uuid.uuid4().hex[:8]}"


async def test_requests_per_minute_are_exact_across_three_gateways(stack: Settings) -> None:
    clients = [make_redis(stack.redis) for _ in range(3)]
    limiters = [RateLimiter(c, stack.redis, lease_s=60, reservation_ttl_s=600) for c in clients]
    key_id, org_id = _ids()
    limits = Limits(requests_per_minute=10, tokens_per_minute=10**9, max_concurrent=1000)
    started = time.monotonic()
    try:
        answers = await asyncio.gather(*(
            limiters[i % 3].admit(f"r{i}-{uuid.uuid4().hex}", 5, key_id=key_id, org_id=org_id, key_limits=limits,
                                  org_limits=WIDE) for i in range(100)))
    finally:
        for client in clients:
            await client.aclose()
    elapsed = time.monotonic() - started
    admitted = [a for a in answers if isinstance(a, Admitted)]
    refused = [a for a in answers if isinstance(a, Refused)]
    # 10 per minute refill one every 6 s: within 6 s, exactly the bucket's 10
    assert elapsed < 6
    assert len(admitted) == 10 and len(refused) == 90
    assert {(r.limit, r.scope) for r in refused} == {("requests", "key")}
    assert all(0 < r.retry_after_ms <= 6000 for r in refused)
    assert sorted(a.window.requests_remaining for a in admitted) == list(range(10))
    assert all(r.window.requests_remaining == 0 and r.headers()["x-ratelimit-limit-requests"] == "10"
               for r in refused)


async def test_tokens_are_reserved_then_settled_once_and_the_counters_say_what_was_used(stack: Settings) -> None:
    redis = make_redis(stack.redis)
    limiter = RateLimiter(redis, stack.redis, lease_s=60, reservation_ttl_s=600)
    key_id, org_id = _ids()
    limits = Limits(requests_per_minute=1000, tokens_per_minute=5000, max_concurrent=1000)
    try:
        ids = [f"r{i}-{uuid.uuid4().hex}" for i in range(7)]
        answers = [await limiter.admit(rid, 1000, key_id=key_id, org_id=org_id, key_limits=WIDE, org_limits=limits)
                   for rid in ids]
        assert [isinstance(a, Admitted) for a in answers] == [True] * 5 + [False] * 2
        refused = answers[5]
        assert isinstance(refused, Refused) and (refused.limit, refused.scope) == ("tokens", "org")
        # each used 200 of its 1000: 4000 come back, enough for 4 more
        for rid in ids[:5]:
            assert await limiter.settle(rid, 200) is True
            assert await limiter.settle(rid, 200) is False  # once
        more = [await limiter.admit(f"m{i}-{uuid.uuid4().hex}", 1000, key_id=key_id, org_id=org_id,
                                    key_limits=WIDE, org_limits=limits) for i in range(5)]
        assert sum(isinstance(a, Admitted) for a in more) == 4
        assert int(await redis.get(limiter.settled_key("org", org_id))) == 1000
        assert int(await redis.get(limiter.settled_key("key", key_id))) == 1000
        too_big = await limiter.admit(f"big-{uuid.uuid4().hex}", 6000, key_id=key_id, org_id=org_id,
                                      key_limits=WIDE, org_limits=limits)
        assert isinstance(too_big, Refused) and too_big.retry_after_ms == -1
    finally:
        await redis.aclose()


async def test_requests_in_flight_are_limited_and_freed_by_settlement(stack: Settings) -> None:
    redis = make_redis(stack.redis)
    limiter = RateLimiter(redis, stack.redis, lease_s=60, reservation_ttl_s=600)
    key_id, org_id = _ids()
    limits = Limits(requests_per_minute=1000, tokens_per_minute=10**9, max_concurrent=3)
    try:
        run = uuid.uuid4().hex
        first = [await limiter.admit(f"f{i}-{run}", 1, key_id=key_id, org_id=org_id, key_limits=limits, org_limits=WIDE)
                 for i in range(4)]
        assert [isinstance(a, Admitted) for a in first] == [True, True, True, False]
        assert isinstance(first[3], Refused) and first[3].limit == "concurrent"
        await limiter.settle(f"f0-{run}", 1)
        again = await limiter.admit(f"f4-{run}", 1, key_id=key_id, org_id=org_id, key_limits=limits, org_limits=WIDE)
        assert isinstance(again, Admitted)
        assert again.headers()["x-ratelimit-limit-requests"] == "1000"
    finally:
        await redis.aclose()


def test_reset_durations_are_written_as_openai_writes_them() -> None:
    assert [duration(ms) for ms in (20, 999, 1000, 1001, 59_500, 60_000, 360_000)] == [
        "20ms", "999ms", "1s", "2s", "1m0s", "1m0s", "6m0s"]


async def test_release_frees_the_slot_and_settle_many_settles_each_once(stack: Settings) -> None:
    redis = make_redis(stack.redis)
    limiter = RateLimiter(redis, stack.redis, lease_s=60, reservation_ttl_s=600)
    key_id, org_id = _ids()
    limits = Limits(requests_per_minute=1000, tokens_per_minute=10**9, max_concurrent=2)
    ids = [f"s{i}-{uuid.uuid4().hex}" for i in range(3)]
    try:
        for rid in ids[:2]:
            assert isinstance(await limiter.admit(rid, 50, key_id=key_id, org_id=org_id, key_limits=limits,
                                                  org_limits=WIDE), Admitted)
        await limiter.release(ids[0], key_id=key_id, org_id=org_id)  # the client's answer ended
        assert isinstance(await limiter.admit(ids[2], 50, key_id=key_id, org_id=org_id, key_limits=limits,
                                              org_limits=WIDE), Admitted)
        assert await limiter.settle_many([(ids[0], 30, True), (ids[1], 0, False), (ids[2], 50, True)]) == 3
        assert await limiter.settle_many([(ids[0], 30, True)]) == 0
        assert int(await redis.get(limiter.settled_key("key", key_id))) == 80
    finally:
        await redis.aclose()
