"""The gateway's memory of key suspensions (``KeySuspensions.reason``): one Redis read per key per interval, shared
by the requests that wait for it; a suspension or lift made here is seen here at once; once started, the answers
of the keys in use are read again ahead of time, so their requests do not wait for Redis, and never outlive the
interval. Redis is a fake (pure logic: the real one is exercised by the abuse e2e tests); the tests about intervals
run on a virtual clock (the cache's clock is the event loop's)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from runtime.settings import RedisSettings
from runtime.suspensions import KeySuspensions
from tests.helpers import in_virtual_time


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
        #: pipelined round trips (the refresher's)
        self.round_trips = 0
        self.pipeline_gate = asyncio.Event()
        self.pipeline_gate.set()

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

    def pipeline(self, transaction: bool = True) -> FakePipeline:
        return FakePipeline(self)


class FakePipeline:
    def __init__(self, redis: FakeRedis) -> None:
        self._redis = redis
        self._keys: list[str] = []

    async def __aenter__(self) -> FakePipeline:
        return self

    async def __aexit__(self, *_: object) -> None:
        return None

    def get(self, key: str) -> None:
        self._keys.append(key)

    async def execute(self) -> list[str | None]:
        self._redis.round_trips += 1
        await self._redis.pipeline_gate.wait()
        if self._redis.down:
            raise RedisConnectionError("down")
        return [self._redis.values.get(k) for k in self._keys]


@contextlib.asynccontextmanager
async def refreshing(redis: FakeRedis, remember_s: float) -> AsyncIterator[KeySuspensions]:
    """Suspensions whose refresher runs for the block."""
    s = suspensions(redis, remember_s=remember_s)
    s.start()
    try:
        yield s
    finally:
        await s.stop()


def suspensions(redis: FakeRedis, remember_s: float = 0.25) -> KeySuspensions:
    session: Any = FakeSession()
    fake: Any = redis
    return KeySuspensions(session, "ks", fake, RedisSettings(), remember_s=remember_s,
                          clock=asyncio.get_running_loop().time)


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


@in_virtual_time
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

    monkeypatch.setattr("runtime.suspensions.execute", recorded)
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


@in_virtual_time
async def test_a_key_in_use_is_read_ahead_and_its_requests_do_not_wait_for_redis() -> None:
    redis = FakeRedis()
    async with refreshing(redis, remember_s=0.1) as s:
        assert await s.reason("k1") is None and redis.gets == 1
        for _ in range(6):
            await asyncio.sleep(0.05)
            redis.gate.clear()  # a request that read Redis itself would wait here forever
            assert await asyncio.wait_for(s.reason("k1"), 1) is None
            redis.gate.set()
        assert redis.gets == 1 and redis.round_trips >= 2


@in_virtual_time
async def test_a_suspension_reaches_a_key_in_use_within_the_interval() -> None:
    redis = FakeRedis()
    async with refreshing(redis, remember_s=0.1) as s:
        assert await s.reason("k1") is None
        redis.values[s._cache_key("k1")] = "abuse"  # the detector suspended it
        await asyncio.sleep(0.1)
        assert await s.reason("k1") == "abuse"
        assert redis.gets == 1  # the refresher's read brought it


@in_virtual_time
async def test_an_answer_the_refresher_cannot_renew_is_not_used_past_the_interval() -> None:
    redis = FakeRedis()
    async with refreshing(redis, remember_s=0.1) as s:
        assert await s.reason("k1") is None
        redis.down = True
        await asyncio.sleep(0.15)
        with pytest.raises(RedisConnectionError):
            await s.reason("k1")
        redis.down = False
        assert await s.reason("k1") is None


async def test_a_refresh_under_way_does_not_undo_a_suspension_made_here(monkeypatch: pytest.MonkeyPatch) -> None:
    async def recorded(*_: object) -> list[dict[str, object]]:
        return []

    monkeypatch.setattr("runtime.suspensions.execute", recorded)
    redis = FakeRedis()
    s = suspensions(redis, remember_s=60)
    s._asking = True  # what start() does, without its timer: the refresh is driven by hand
    assert await s.reason("k1") is None
    redis.pipeline_gate.clear()
    refreshing = asyncio.ensure_future(s.refresh(older_than=0))
    await asyncio.sleep(0)  # its read is under way: Redis answers "not suspended"
    await s.suspend("k1", "org", "abuse", "alert-1")
    redis.values.pop(s._cache_key("k1"))  # what Redis said before the suspension reached it
    redis.pipeline_gate.set()
    assert await refreshing == 1
    assert await s.reason("k1") == "abuse"


@in_virtual_time
async def test_keys_unused_for_a_while_are_no_longer_read() -> None:
    redis = FakeRedis()
    s = suspensions(redis, remember_s=60)
    s._keep_s = 0.05
    s._asking = True
    assert await s.reason("k1") is None
    assert await s.refresh(older_than=0) == 1
    await asyncio.sleep(0.06)
    assert await s.refresh(older_than=0) == 0
    assert redis.round_trips == 1


async def test_a_stopped_cache_keeps_no_list_of_keys() -> None:
    s = suspensions(FakeRedis())
    assert await s.reason("k1") is None
    assert s._asked == {}
    s.start()
    assert await s.reason("k2") is None
    assert s._asked
    await s.stop()
    assert s._asked == {} and await s.refresh(older_than=0) == 0


class SlowReplyRedis(FakeRedis):
    async def get(self, key: str) -> str | None:
        self.gets += 1
        value = self.values.get(key)  # Redis runs the GET now ...
        await self.gate.wait()  # ... and its reply is slow to come back
        return value


@in_virtual_time
async def test_a_request_never_joins_a_read_older_than_the_interval() -> None:
    """Review: a request joined the read under way however long ago it began, and could be let through on an
    answer from before a suspension that reached Redis many intervals earlier."""
    redis = SlowReplyRedis()
    s = suspensions(redis, remember_s=0.05)
    redis.gate.clear()
    first = asyncio.ensure_future(s.reason("k1"))  # its read begins
    await asyncio.sleep(0.01)
    redis.values[s._cache_key("k1")] = "abuse"  # the suspension reaches Redis
    await asyncio.sleep(0.2)
    late = asyncio.ensure_future(s.reason("k1"))  # a request 4 intervals later
    await asyncio.sleep(0)
    redis.gate.set()
    await first  # None, or the newer answer when the later read is back first
    assert await late == "abuse"


@in_virtual_time
async def test_the_refresher_reads_at_most_its_cap_the_most_recently_asked_first() -> None:
    redis = FakeRedis()
    s = suspensions(redis, remember_s=60)
    s._refresh_max_keys = 2
    s._asking = True
    for key_id in ("k1", "k2", "k3"):
        assert await s.reason(key_id) is None
        await asyncio.sleep(0.001)
    redis.values[s._cache_key("k1")] = "abuse"
    redis.values[s._cache_key("k3")] = "abuse"
    assert await s.refresh(older_than=0) == 2
    assert s._known["k3"][1] == "abuse" and s._known["k1"][1] is None  # k1, asked first, was left out


@in_virtual_time
async def test_a_refresher_that_meets_an_unexpected_error_goes_on() -> None:
    redis = FakeRedis()
    s = suspensions(redis, remember_s=0.05)
    failures = 0

    async def refresh(*, older_than: float) -> int:
        nonlocal failures
        failures += 1
        raise ValueError("a bug of ours")

    s.refresh = refresh  # type: ignore[method-assign]
    s.start()
    await asyncio.sleep(0.11)
    assert failures == 4 and s._refresher is not None and not s._refresher.done()  # every remember_s / 2
    await s.stop()


@in_virtual_time
async def test_while_redis_is_down_a_key_last_seen_suspended_is_still_known_suspended() -> None:
    """Review finding L7: with Redis down, tiers served locally skipped the suspension list altogether."""
    redis = FakeRedis()
    s = suspensions(redis, remember_s=0.05)
    redis.values[s._cache_key("abuser")] = "request_burst"
    assert await s.reason("abuser") == "request_burst" and await s.reason("fine") is None
    redis.down = True
    await asyncio.sleep(0.06)  # the answers are past their interval: a read of its own would meet the outage
    with pytest.raises(RedisConnectionError):
        await s.reason("abuser")
    assert s.last_known("abuser") == "request_burst"
    assert s.last_known("fine") is None and s.last_known("never-seen") is None
