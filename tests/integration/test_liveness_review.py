"""Adversarial review of the fast failover against the real Kafka and Redis: a Redis outage a little longer than
the lease TTL, every worker alive throughout, must not evict anyone ("an unknown is not a death")."""

from __future__ import annotations

import asyncio
import contextlib
import uuid

from aiokafka import AIOKafkaConsumer
from redis.asyncio import Redis

from inference_workers.liveness import WorkerLiveness
from runtime.kafka_clients import make_consumer
from runtime.metrics import WORKER_EVICTIONS
from runtime.redis_client import make_redis
from runtime.settings import Settings
from schemas.topics import TOPICS


def _judged_peers(life: WorkerLiveness) -> bool:
    """Whether the worker's last beat trusted Redis (renewals through for its trust window): it checked its peers'
    leases then, and any eviction it started has been answered."""
    since, last = life._trusted_since, life._last_renewal
    return since is not None and last is not None and last - since >= life._trust_after_s and not life._evicting


async def _poll(consumers: list[AIOKafkaConsumer], seconds: float) -> None:
    loop = asyncio.get_running_loop()
    until = loop.time() + seconds
    while loop.time() < until:
        for c in consumers:
            await c.getmany(timeout_ms=50)


async def test_a_redis_outage_a_little_longer_than_the_ttl_evicts_no_live_worker(stack: Settings,
                                                                                  redis: Redis) -> None:
    """Redis away 1.5 s (every lease of 1 s lapses) and back: once every worker has judged its peers again (a beat
    after its trust window, with no LeaveGroup still on its way), none was evicted and the group kept its members."""
    group = f"liveness-review-{uuid.uuid4().hex[:8]}"
    topic = stack.kafka.topic(TOPICS.requests_admitted.name)
    partitions = TOPICS.requests_admitted.partitions
    kafka = stack.kafka.model_copy(update={"session_timeout_ms": 30000})
    consumers = [make_consumer(kafka, role=f"live-{i}", group=group) for i in range(3)]
    for c in consumers:
        c.subscribe([topic])
    await asyncio.gather(*(c.start() for c in consumers))
    # Redis as the workers see it during the outage: every command fails (connection refused)
    unreachable = make_redis(stack.redis.model_copy(update={"url": "redis://127.0.0.1:1/0",
                                                            "connect_timeout_s": 0.1}))
    lives = [WorkerLiveness(redis, stack.redis, c, group=kafka.group(group), instance_id=f"live-{i}",
                            ttl_s=1.0, renew_s=0.2) for i, c in enumerate(consumers)]
    loops: list[asyncio.Task[None]] = []
    try:
        for _ in range(300):
            await _poll(consumers, 0.1)
            if sum(len(c.assignment()) for c in consumers) == partitions and all(c.assignment()
                                                                                 for c in consumers):
                break
        loops = [asyncio.ensure_future(life.run()) for life in lives]
        await _poll(consumers, 1.0)  # healthy: every lease and directory entry written
        members = [c._coordinator.member_id for c in consumers]
        evicted_before = WORKER_EVICTIONS.labels(outcome="evicted")._value.get()

        for life in lives:
            life._redis = unreachable  # Redis down for 1.5 s
        await _poll(consumers, 1.5)
        for life in lives:  # back: each worker reconnects at its own moment
            life._redis = redis
            await _poll(consumers, 0.05)
        deadline = asyncio.get_running_loop().time() + 20
        while not all(_judged_peers(life) for life in lives):  # where an eviction would have been sent
            assert asyncio.get_running_loop().time() < deadline, "a worker never judged its peers after the outage"
            await _poll(consumers, 0.1)

        evicted = WORKER_EVICTIONS.labels(outcome="evicted")._value.get() - evicted_before
        assert evicted == 0, f"{evicted} live workers evicted after a 1.5 s Redis outage"
        assert [c._coordinator.member_id for c in consumers] == members
    finally:
        for t in loops:
            t.cancel()
        await asyncio.gather(*loops, return_exceptions=True)
        for life in lives:
            with contextlib.suppress(Exception):
                await life.close()
        await asyncio.gather(*(c.stop() for c in consumers), return_exceptions=True)
        await unreachable.aclose()
