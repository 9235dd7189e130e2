"""Fast failover: a dead worker is found by a short Redis lease and evicted from the group by its peers.

Kafka takes a dead group member for dead only after its session timeout (6 s at the broker's minimum, 10 s
here): for that long the requests it was generating stay silent. Instead every worker holds a lease in Redis
(``ttl_s``, renewed every ``renew_s``) naming its current group member id, and lists itself in the group's
directory. Every worker checks its peers at each renewal: a peer whose lease is gone is evicted at once with a
LeaveGroup request in its name (Kafka's coordinator accepts it for any member id, as the admin client's
``removeMembersFromConsumerGroup`` does for static members), and the checker rejoins right away instead of
waiting for its next heartbeat. The rebalance then hands the dead worker's partitions to the survivors, which
take its requests over from what they emitted (``prefix.py``, ``resume.py``).

Cost in steady state: per worker, two Redis round trips per ``renew_s`` (renew; check). What a false positive
costs: a live worker whose event loop stalls past ``ttl_s`` is evicted; it rejoins as a new member at its next
heartbeat and its requests are taken over by their partitions' new owners — the fencing of ``transactions.py``
keeps that exact, only the work is repeated. Redis unreachable: no lease is renewed and nobody is evicted (an
unknown is not a death); once it answers again, a worker judges its peers only after its own renewals have gone
through for a TTL and a renewal period (every lease lapsed during the outage, live peers need that long to take
theirs back); the session timeout remains the floor. A LeaveGroup runs beside the renewals, never delaying them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from functools import partial

from aiokafka import AIOKafkaConsumer
from aiokafka import errors as Errors
from aiokafka.errors import KafkaError
from aiokafka.protocol.group import LeaveGroupRequest
from redis.asyncio import Redis
from redis.exceptions import RedisError

from runtime.metrics import WORKER_EVICTIONS
from runtime.redis_client import key
from runtime.settings import RedisSettings

log = logging.getLogger(__name__)

UNKNOWN_MEMBER = ""

# KEYS[1]: the directory hash, ARGV: instance, member id. Deletes the entry only if it still names that member (a
# restarted worker with the same instance id has registered its new member id meanwhile).
_FORGET = """
if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then return redis.call('HDEL', KEYS[1], ARGV[1]) end
return 0
"""


class WorkerLiveness:
    def __init__(self, redis: Redis, settings: RedisSettings, consumer: AIOKafkaConsumer, *, group: str,
                 instance_id: str, ttl_s: float, renew_s: float, trust_after_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._redis = redis
        #: times the renewals and the trust window (a test passes its event loop's virtual clock)
        self._clock = clock
        self._consumer = consumer
        self._group = group
        self._instance = instance_id
        self._ttl_s = ttl_s
        self._ttl_ms = int(ttl_s * 1000)
        self._renew_s = renew_s
        self._directory = key(settings, "workers", group)
        self._lease = lambda instance: key(settings, "worker-alive", group, instance)
        self._forget = redis.register_script(_FORGET)
        #: how long renewals must have gone through before peers are judged: after an outage (or a late renewal)
        #: every lease lapsed at once, and live peers need a renewal period to take theirs back
        self._trust_after_s = ttl_s + renew_s if trust_after_s is None else trust_after_s
        self._trusted_since: float | None = None
        self._last_renewal: float | None = None
        #: evictions sent (instance → member id), not repeated while the coordinator rebalances
        self._evicted: dict[str, str] = {}
        self._evicting: dict[str, asyncio.Task[None]] = {}
        #: the member id this worker last announced
        self._announced = UNKNOWN_MEMBER

    def member_id(self) -> str:
        """This worker's member id in the group, once it joined (aiokafka keeps it on its coordinator)."""
        coordinator = self._consumer._coordinator
        if coordinator is None or coordinator.generation <= 0:
            return UNKNOWN_MEMBER
        return str(coordinator.member_id or UNKNOWN_MEMBER)

    async def run(self) -> None:
        try:
            while True:
                started = self._clock()
                try:
                    await self.beat()
                except (RedisError, OSError, TimeoutError) as exc:
                    log.debug("worker lease not renewed", extra={"reason": repr(exc)})
                await asyncio.sleep(max(0.0, self._renew_s - (self._clock() - started)))
        finally:
            for task in self._evicting.values():
                task.cancel()

    async def beat(self) -> None:
        """Renew this worker's lease, then evict the peers whose lease is gone (once Redis can be trusted)."""
        member = self.member_id()
        if member == UNKNOWN_MEMBER:
            return  # not in the group (yet): nothing to announce, nobody to judge
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.set(self._lease(self._instance), member, px=self._ttl_ms)
                pipe.hset(self._directory, self._instance, member)
                pipe.hgetall(self._directory)
                *_, directory = await pipe.execute()
        except BaseException:
            self._trusted_since = None  # an outage: every lease may lapse meanwhile, live peers' included
            raise
        self._announced = member
        if not self._trusted():
            return
        peers = {i: m for i, m in directory.items() if i != self._instance}
        if not peers:
            return
        leases = await self._redis.mget([self._lease(i) for i in peers])
        started = []
        for (instance, peer_member), lease in zip(peers.items(), leases, strict=True):
            if lease is None and self._evicted.get(instance) != peer_member and instance not in self._evicting:
                task = asyncio.ensure_future(self._evict(instance, peer_member))
                self._evicting[instance] = task
                task.add_done_callback(partial(self._evicted_done, instance))
                started.append(task)
        if started:
            # A LeaveGroup answered at once is done here; a slow coordinator never holds up the next renewal.
            await asyncio.wait(started, timeout=self._renew_s / 2)

    def _evicted_done(self, instance: str, _task: asyncio.Task[None]) -> None:
        self._evicting.pop(instance, None)

    def _trusted(self) -> bool:
        """Whether Redis has held this worker's lease long enough for a missing peer lease to mean a dead peer."""
        now = self._clock()
        if self._last_renewal is not None and now - self._last_renewal > self._ttl_s:
            self._trusted_since = None  # this worker's own renewal came late: its lease (and others') lapsed
        self._last_renewal = now
        if self._trusted_since is None:
            self._trusted_since = now
        return now - self._trusted_since >= self._trust_after_s

    async def _evict(self, instance: str, member: str) -> None:
        coordinator = self._consumer._coordinator
        try:
            response = await asyncio.wait_for(coordinator._send_req(LeaveGroupRequest(self._group, member)),
                                              timeout=max(self._ttl_s, 1.0))
            error = Errors.for_code(response.error_code)
        except (KafkaError, TimeoutError) as exc:
            error = type(exc)
        if error is Errors.NoError:
            outcome = "evicted"
            coordinator.request_rejoin()  # now, not at the next heartbeat: the rebalance waits for every member
        elif error is Errors.UnknownMemberIdError:
            outcome = "already_gone"  # it left, another peer evicted it, or its session timed out: no rebalance
        else:
            log.warning("could not evict a dead worker; its session timeout will", extra={
                "instance": instance, "member": member, "reason": error.__name__})
            return
        self._evicted[instance] = member
        WORKER_EVICTIONS.labels(outcome=outcome).inc()
        log.warning("dead worker evicted from the group", extra={"instance": instance, "member": member,
                                                                 "outcome": outcome})
        # Best effort: an entry that stays names a member evicted already, which the next check leaves alone.
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            await self._forget(keys=[self._directory], args=[instance, member])

    async def close(self) -> None:
        """A graceful stop (after the consumer left the group): nothing left for the peers to evict. The directory
        entry goes first: a listed member without a lease is what a peer takes for dead."""
        # On failure the lease expires; a peer's eviction of a member that left is answered "unknown member".
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            if self._announced != UNKNOWN_MEMBER:
                await self._forget(keys=[self._directory], args=[self._instance, self._announced])
            await self._redis.delete(self._lease(self._instance))
