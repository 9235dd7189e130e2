"""The gateway's memory of key suspensions (``KeySuspensions.reason``): one Redis read per key per interval, shared
by the requests that wait for it; a suspension or lift made here is seen here at once. Redis is a fake (pure logic:
the real one is exercised by the abuse e2e tests)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from producers.gateway.keys import KeySuspensions
from runtime.settings import RedisSettings


class FakeSession:
    def prepare(self, query: str) -> str:
        return query


class FakeRedis:
    def __init__(self) -> None:
        self.values: dict[str, str] = {}
        self.gets = 0
        self.gate = asyncio.Event()
        self.gate.set()
        self.down = False

    async def get(self, key: str) -> str | None:
        self.gets += 1
        await self.gate.wait()
        if self.down:
            raise RedisConnectionError("down")
        return self.values.get(key)

    async def set(self, key: str, value: str) -> None:
        self.values[key] = value

    async def delete(self, key: str) -> int:
        return 1 if self.values.pop(key, None) is not None else 0


def suspensions(redis: FakeRedis, remember_s: float = 0.25) -> KeySuspensions:
    session: Any = FakeSession()
    fake: Any = redis
    return KeySuspensions(session, "ks", fake, RedisSettings(), remember_s=remember_s)


async def test_requests_waiting_together_share_one_read() -> None:
    redis = FakeRedis()
    redis.gate.clear()
    s = suspensions(redis)
    waiting = [asyncio.ensure_future(s.reason("k1")) for _ in range(50)]
    await asyncio.sleep(0)
    redis.gate.set()
    assert await asyncio.gather(*waiting) == [None] * 50
    assert redis.gets == 1
    assert await s.reason("k1") is None and redis.gets == 1  # remembered


async def test_a_suspension_in_redis_is_seen_after_the_interval() -> None:
    redis = FakeRedis()
    s = suspensions(redis, remember_s=0.05)
    assert await s.reason("k1") is None
    redis.values[s._cache_key("k1")] = "abuse"  # another gateway (the detector) suspended it
    await asyncio.sleep(0.06)
    assert await s.reason("k1") == "abuse"
    assert redis.gets == 2


async def test_suspend_and_lift_here_are_seen_here_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    async def recorded(*_: object) -> list[dict[str, object]]:  # the Cassandra record is not what is tested
        return []

    monkeypatch.setattr("producers.gateway.keys.execute", recorded)
    redis = FakeRedis()
    s = suspensions(redis, remember_s=60)
    assert await s.reason("k1") is None
    await s.suspend("k1", "org", "abuse", "alert-1")
    assert await s.reason("k1") == "abuse"
    assert await s.lift("k1") is True
    assert await s.reason("k1") is None
    assert redis.gets == 1  # the first answer only: what this process suspends and lifts it knows


async def test_a_caller_that_leaves_does_not_cancel_the_read_of_the_others() -> None:
    redis = FakeRedis()
    redis.gate.clear()
    s = suspensions(redis)
    first = asyncio.ensure_future(s.reason("k1"))
    second = asyncio.ensure_future(s.reason("k1"))
    await asyncio.sleep(0)
    first.cancel()
    redis.values[s._cache_key("k1")] = "abuse"
    redis.gate.set()
    assert await second == "abuse"
    with pytest.raises(asyncio.CancelledError):
        await first


async def test_redis_down_is_not_remembered() -> None:
    redis = FakeRedis()
    s = suspensions(redis, remember_s=60)
    redis.down = True
    with pytest.raises(RedisConnectionError):
        await s.reason("k1")
    redis.down = False
    assert await s.reason("k1") is None
    assert redis.gets == 2
