"""Fast failover (issue 10): a SIGKILLed worker's peers evict it from the group as soon as its Redis lease lapses,
long before the Kafka session timeout would (set to 30 s here, so that only the eviction can explain the
rebalance). The time from the kill until the survivor holds every partition is printed, and bounded at 10 s: a
third of the session timeout, so a failover that waited for it fails, with room for a rebalance on a loaded box
(the lease's 1 s, a beat, a LeaveGroup and one group join: about 1 s on an idle box here)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import textwrap
import time
import uuid

import pytest
from aiokafka import AIOKafkaConsumer
from redis.asyncio import Redis

from inference_workers.liveness import WorkerLiveness
from runtime.kafka_clients import make_consumer
from runtime.metrics import WORKER_EVICTIONS
from runtime.redis_client import key
from runtime.settings import Settings
from schemas.topics import TOPICS
from tests.helpers import wait_for

VICTIM = textwrap.dedent("""
    import asyncio, sys
    from inference_workers.liveness import WorkerLiveness
    from runtime.kafka_clients import make_consumer
    from runtime.redis_client import make_redis
    from runtime.settings import load_settings

    async def main(group, topic):
        s = load_settings()
        kafka = s.kafka.model_copy(update={"session_timeout_ms": 30000})
        consumer = make_consumer(kafka, role="victim", group=group)
        consumer.subscribe([topic])
        await consumer.start()
        liveness = WorkerLiveness(make_redis(s.redis), s.redis, consumer, group=kafka.group(group),
                                  instance_id="victim", ttl_s=1.0, renew_s=0.2)
        asyncio.ensure_future(liveness.run())
        while True:
            await consumer.getmany(timeout_ms=200)
            if consumer.assignment():
                print("assigned", len(consumer.assignment()), flush=True)

    asyncio.run(main(sys.argv[1], sys.argv[2]))
""")


#: far below the 30 s session timeout: the failover must come from the lease, not from Kafka
FAILOVER_BOUND_S = 10.0


async def _announced(redis: Redis, settings: Settings, group: str) -> bool:
    """Whether the victim holds its lease and is listed in the group's directory (a peer can judge it from then)."""
    lease = await redis.get(key(settings.redis, "worker-alive", group, "victim"))
    listed = await redis.hget(key(settings.redis, "workers", group), "victim")
    return lease is not None and listed is not None


async def _assigned(consumer: AIOKafkaConsumer, n: int, timeout_s: float) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        await consumer.getmany(timeout_ms=100)
        if len(consumer.assignment()) == n:
            return time.monotonic() - started
    raise AssertionError(f"{len(consumer.assignment())} partitions assigned, not {n}, after {timeout_s} s")


@pytest.mark.timeout(240)  # two group joins (up to 60 s each) and the eviction (up to 25 s)
async def test_a_killed_worker_is_evicted_by_its_peer_before_its_session_times_out(stack: Settings,
                                                                                   redis: Redis) -> None:
    group = f"liveness-{uuid.uuid4().hex[:8]}"
    topic = stack.kafka.topic(TOPICS.requests_admitted.name)
    partitions = TOPICS.requests_admitted.partitions
    kafka = stack.kafka.model_copy(update={"session_timeout_ms": 30000})
    victim = await asyncio.create_subprocess_exec(sys.executable, "-c", VICTIM, group, topic,
                                                  stdout=asyncio.subprocess.PIPE, start_new_session=True)
    consumer = make_consumer(kafka, role="survivor", group=group)
    consumer.subscribe([topic])
    await consumer.start()
    liveness = WorkerLiveness(redis, stack.redis, consumer, group=kafka.group(group), instance_id="survivor",
                              ttl_s=1.0, renew_s=0.2)
    beating = asyncio.ensure_future(liveness.run())
    evicted_before = WORKER_EVICTIONS.labels(outcome="evicted")._value.get()
    try:
        assert victim.stdout is not None
        line = (await asyncio.wait_for(victim.stdout.readline(), 60)).decode()
        assert line.startswith("assigned"), line
        await _assigned(consumer, partitions - int(line.split()[1]), 60)  # both members hold partitions
        await wait_for(lambda: _announced(redis, stack, kafka.group(group)), timeout_s=20, interval_s=0.05,
                       what="the victim's lease and directory entry written")
        os.killpg(victim.pid, signal.SIGKILL)
        taken_s = await _assigned(consumer, partitions, 25)
        print(f"survivor held every partition {taken_s:.2f} s after the kill")
        assert taken_s < FAILOVER_BOUND_S, f"failover took {taken_s:.1f} s: the lease did not find the dead worker"
        assert WORKER_EVICTIONS.labels(outcome="evicted")._value.get() == evicted_before + 1
    finally:
        beating.cancel()
        if victim.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(victim.pid, signal.SIGKILL)
            await asyncio.wait_for(victim.wait(), 10)
        await consumer.stop()
