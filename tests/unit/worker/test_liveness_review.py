"""Adversarial review of the fast failover (inference_workers/liveness.py), with an in-memory Redis and a fake
group coordinator. Each test is named after the behaviour it asserts; its docstring tells how the first version
evicted or rebalanced a healthy group, or lost a dead worker's eviction."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from types import SimpleNamespace
from typing import Any

import pytest
from aiokafka import errors as Errors
from pydantic import ValidationError
from redis.exceptions import ConnectionError as RedisConnectionError

from inference_workers.liveness import WorkerLiveness
from runtime.settings import RedisSettings, WorkerSettings
from tests.helpers import run_in_virtual_time

GROUP = "kns-test-workers"


class FakeRedis:
    """Strings with a PX expiry (on a settable clock), hashes, and a switch that makes Redis unreachable."""

    def __init__(self) -> None:
        self._now = 0.0
        #: when set, the time is read from it (a test's virtual clock) instead of ``now`` as last set
        self.clock: Callable[[], float] | None = None
        self.down = False
        self.strings: dict[str, tuple[str, float]] = {}
        self.hashes: dict[str, dict[str, str]] = {}
        #: awaited after a DEL (another client's commands interleaving between two round trips)
        self.after_delete: Callable[[], Awaitable[None]] | None = None
        self.script_fails = False

    @property
    def now(self) -> float:
        return self._now if self.clock is None else self.clock()

    @now.setter
    def now(self, value: float) -> None:
        self._now = value

    def _check(self) -> None:
        if self.down:
            raise RedisConnectionError("Redis unreachable")

    def _get(self, k: str) -> str | None:
        value = self.strings.get(k)
        if value is None or value[1] <= self.now:
            self.strings.pop(k, None)
            return None
        return value[0]

    def pipeline(self, transaction: bool = False) -> FakePipeline:
        return FakePipeline(self)

    async def mget(self, keys: list[str]) -> list[str | None]:
        self._check()
        return [self._get(k) for k in keys]

    async def delete(self, *keys: str) -> int:
        self._check()
        n = sum(self.strings.pop(k, None) is not None for k in keys)
        if self.after_delete is not None:
            await self.after_delete()
        return n

    def register_script(self, _source: str) -> Callable[..., Awaitable[int]]:
        async def forget(keys: list[str], args: list[str]) -> int:
            self._check()
            if self.script_fails:
                raise RedisConnectionError("connection reset while running the script")
            h = self.hashes.get(keys[0], {})
            if h.get(args[0]) == args[1]:
                del h[args[0]]
                return 1
            return 0
        return forget


class FakePipeline:
    def __init__(self, redis: FakeRedis) -> None:
        self._redis = redis
        self._ops: list[Callable[[], Any]] = []

    async def __aenter__(self) -> FakePipeline:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    def set(self, k: str, v: str, px: int) -> None:
        if px <= 0:
            def fail() -> Any:
                raise RuntimeError("ERR invalid expire time in 'set' command")
            self._ops.append(fail)
            return
        self._ops.append(lambda: self._redis.strings.__setitem__(k, (v, self._redis.now + px / 1000)))

    def hset(self, k: str, field: str, v: str) -> None:
        self._ops.append(lambda: self._redis.hashes.setdefault(k, {}).__setitem__(field, v))

    def hgetall(self, k: str) -> None:
        self._ops.append(lambda: dict(self._redis.hashes.get(k, {})))

    async def execute(self) -> list[Any]:
        self._redis._check()
        return [op() for op in self._ops]


class Group:
    """The coordinator's view: the member ids in the group, and every LeaveGroup and rejoin request."""

    def __init__(self) -> None:
        self.members: set[str] = set()
        self.leaves: list[tuple[str, str]] = []  # (sender, member)
        self.rejoins: list[str] = []


class FakeCoordinator:
    def __init__(self, group: Group, name: str, member: str, leave_delay_s: float = 0.0) -> None:
        self.group, self.name = group, name
        self.generation, self.member_id = 1, member
        self.coordinator_id: int | None = 1
        self.leave_delay_s = leave_delay_s
        group.members.add(member)

    async def _send_req(self, request: Any) -> Any:
        if self.coordinator_id is None:
            raise Errors.GroupCoordinatorNotAvailableError()
        if self.leave_delay_s:
            await asyncio.sleep(self.leave_delay_s)  # an unresponsive coordinator: up to request_timeout_ms
        member = request._member_id
        self.group.leaves.append((self.name, member))
        if member in self.group.members:
            self.group.members.discard(member)
            return SimpleNamespace(error_code=0)
        return SimpleNamespace(error_code=Errors.UnknownMemberIdError.errno)

    def request_rejoin(self) -> None:
        self.group.rejoins.append(self.name)


def _worker(redis: FakeRedis, group: Group, name: str, *, ttl_s: float = 1.0, renew_s: float = 0.2,
            leave_delay_s: float = 0.0, trust_after_s: float | None = 0.0,
            clock: Callable[[], float] = time.monotonic) -> WorkerLiveness:
    """``trust_after_s`` 0: peers are judged from the first beat (the fake clock is not the worker's); None: the
    real window (a TTL and a renewal period of successful renewals)."""
    coordinator = FakeCoordinator(group, name, f"{name}-member-1", leave_delay_s)
    consumer = SimpleNamespace(_coordinator=coordinator)
    return WorkerLiveness(redis, RedisSettings(), consumer, group=GROUP,  # type: ignore[arg-type]
                          instance_id=name, ttl_s=ttl_s, renew_s=renew_s, trust_after_s=trust_after_s, clock=clock)


async def test_after_a_redis_outage_longer_than_the_ttl_the_first_worker_back_evicts_no_live_peer() -> None:
    """Redis unreachable (a network blip, a restart with persistence, a replica promoted) for more than ttl_s: no
    worker can renew, every lease lapses while the directory (no TTL) stays. The first worker whose beat reaches
    Redis again finds every other lease gone; it must not evict its live peers (the first version did: a
    whole-group rebalance in which every in-flight request of the evicted workers is aborted and taken over)."""
    redis, group = FakeRedis(), Group()
    workers = [_worker(redis, group, name, trust_after_s=None) for name in ("a", "b", "c", "d")]
    for w in workers:
        await w.beat()
    assert group.leaves == []  # healthy group, every lease fresh

    redis.down = True  # 1.5 s without Redis: every renewal fails (run() swallows it at debug level)
    for t in (0.2, 0.4, 0.6, 0.8, 1.0, 1.2, 1.4):
        redis.now = t
        for w in workers:
            with pytest.raises(RedisConnectionError):
                await w.beat()
    redis.down = False
    redis.now = 1.5
    await workers[0].beat()  # the first one back: every peer is alive and will renew within renew_s

    assert group.leaves == [], f"live peers evicted after a Redis outage: {group.leaves}"
    assert group.members == {"a-member-1", "b-member-1", "c-member-1", "d-member-1"}


def test_a_slow_leave_group_never_holds_up_the_evictors_own_renewal() -> None:
    """The renewal and the evictions share one loop and LeaveGroup has no deadline of its own (the client's
    request_timeout_ms, 30 s here). In the first version a coordinator slow to answer (a broker under load or
    failing over) kept the evicting worker from renewing: its own lease lapsed and its peers evicted it too, a live
    worker. On a virtual clock (the fake Redis reads the loop's time): the LeaveGroup takes 1 s, the survivor's
    lease 0.3 s, and an observer beats at 0.65 s while the LeaveGroup is still on its way."""
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        redis, group = FakeRedis(), Group()
        dead = _worker(redis, group, "dead", ttl_s=0.3, renew_s=0.1)
        await dead.beat()  # at 0: its lease is gone by 0.3
        redis.clock = lambda: loop.time() + 0.5  # the dead worker's lease already lapsed
        survivor = _worker(redis, group, "survivor", ttl_s=0.3, renew_s=0.1, leave_delay_s=1.0, clock=loop.time)
        observer = _worker(redis, group, "observer", ttl_s=0.3, renew_s=0.1, clock=loop.time)
        beating = asyncio.create_task(survivor.run())
        try:
            await asyncio.sleep(0.65)
            assert "dead" in survivor._evicting, "the survivor's LeaveGroup is not in flight: nothing was tested"
            await observer.beat()
        finally:
            beating.cancel()
            await asyncio.gather(beating, return_exceptions=True)
        evicted = [member for sender, member in group.leaves if sender == "observer"]
        assert "survivor-member-1" not in evicted, "a live worker was evicted: its renewal waited behind a LeaveGroup"
        assert evicted == ["dead-member-1"]

    run_in_virtual_time(scenario)


async def test_a_peer_beating_during_a_graceful_stop_neither_evicts_the_leaver_nor_forces_a_rebalance() -> None:
    """close() takes two round trips (the directory entry, the lease). The first version deleted the lease first: a
    peer beating between the two saw a listed member without a lease, sent LeaveGroup (already gone: it left) and
    request_rejoin(): one more full eager rebalance of a group that had just settled after the graceful leave."""
    redis, group = FakeRedis(), Group()
    leaving, peer = _worker(redis, group, "leaving"), _worker(redis, group, "peer")
    await leaving.beat()
    await peer.beat()
    group.members.discard("leaving-member-1")  # consumer.stop() sent its own LeaveGroup; the group rebalanced

    async def peer_beats() -> None:
        redis.after_delete = None
        await peer.beat()
    redis.after_delete = peer_beats
    await leaving.close()

    assert group.leaves == [] and group.rejoins == [], f"a peer judged a gracefully stopping member dead: " \
                                                       f"{group.leaves}, rejoins {group.rejoins}"


async def test_an_already_gone_member_makes_no_survivor_force_a_rebalance_of_a_stable_group() -> None:
    """A member whose lease lapsed after it had left the group (its close() lost to a Redis error; a worker killed
    between consumer.stop() and close()): every survivor's LeaveGroup is answered UNKNOWN_MEMBER_ID. The first
    version still called request_rejoin(): a stable group rebalanced (eagerly: every partition revoked) for
    nothing."""
    redis, group = FakeRedis(), Group()
    gone = _worker(redis, group, "gone")
    survivors = [_worker(redis, group, n) for n in ("s1", "s2")]
    await gone.beat()
    group.members.discard("gone-member-1")  # it left the group; its directory entry stayed
    redis.now = 1.5
    for s in survivors:
        await s.beat()
    assert group.leaves == [("s1", "gone-member-1")], "nobody asked (answered UNKNOWN_MEMBER_ID; s1 forgot it)"
    assert group.rejoins == [], f"stable group rebalanced by {group.rejoins} for a member already gone"


async def test_a_failed_forget_after_a_successful_eviction_still_requests_the_rejoin_once() -> None:
    """LeaveGroup succeeded, then the directory clean-up (a Redis round trip) failed. The first version raised
    before request_rejoin() with the member already in _evicted, so the eviction was never retried and this
    survivor joined the rebalance only at its next heartbeat (the rebalance waiting for it)."""
    redis, group = FakeRedis(), Group()
    dead, survivor = _worker(redis, group, "dead"), _worker(redis, group, "survivor")
    await dead.beat()
    redis.now = 1.5
    redis.script_fails = True
    await survivor.beat()  # the clean-up's failure is not the eviction's: it is best effort
    redis.script_fails = False
    await survivor.beat()
    assert group.leaves == [("survivor", "dead-member-1")]
    assert group.rejoins == ["survivor"], "the survivor evicted a member and never rejoined at once"


@pytest.mark.parametrize(("ttl_s", "renew_s"), [(1.0, 0.0), (1.0, -0.2), (0.0009, 0.0003)])
def test_the_settings_reject_a_renewal_that_spins_or_a_lease_that_rounds_to_nothing(ttl_s: float,
                                                                                    renew_s: float) -> None:
    """renew_s <= 0 passes the validator (0 * 3 <= ttl): run() then loops without sleeping, two Redis round trips
    back to back forever. ttl_s under 1 ms passes too and becomes PX 0, which Redis refuses: the SET fails while the
    HSET in the same (non-transactional) pipeline succeeds, so the worker is listed without ever holding a lease
    and its peers evict it after every rejoin."""
    with pytest.raises(ValidationError):
        WorkerSettings(liveness_ttl_s=ttl_s, liveness_renew_s=renew_s)
