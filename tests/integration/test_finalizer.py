"""The worker's finalizing transaction on the real broker: final token event + usage + request offsets commit
together, and an unfinished transaction of a dead worker is invisible to read_committed readers."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from aiokafka import TopicPartition
from redis.asyncio import Redis

from inference_workers.claims import ClaimVerdict, RequestClaims
from inference_workers.emitter import Finalizer, Finished
from inference_workers.offsets import OffsetTracker
from runtime.kafka_clients import make_consumer, make_producer
from runtime.settings import KafkaSettings, Settings
from schemas.codec import codec_for
from schemas.events import TokenEvent, TokenUsage, UsageEvent, utcnow
from schemas.topics import TOPICS
from tests.helpers import read_topic

pytestmark = pytest.mark.integration


def finished(rid: str, source: TopicPartition, offset: int, reply: int) -> Finished:
    now = utcnow()
    final = TokenEvent(request_id=rid, attempt=1, seq=3, token_offset=3, token_ids=[2], text="",
                       finish_reason="stop", usage=TokenUsage(prompt_tokens=10, completion_tokens=4),
                       worker_id="w", emitted_at_us=1)
    usage = UsageEvent(request_id=rid, org_id="o", key_id="k", tier="pro", model="m", prompt_tokens=10,
                       completion_tokens=4, cached_tokens=0, finish_reason="stop", attempt=1, worker_id="w",
                       requested_at=now, started_at=now, finished_at=now)
    return Finished(final, usage, reply, source, offset, None, None)


async def test_finished_requests_commit_with_their_offsets(stack: Settings, redis: Redis) -> None:
    kafka: KafkaSettings = stack.kafka
    group = f"finalizer-test-{uuid.uuid4().hex[:6]}"
    source = TopicPartition(kafka.topic(TOPICS.requests_admitted.name), 2)
    offsets = OffsetTracker()
    offsets.assign([source])
    for offset in (40, 41, 42):
        offsets.taken(source, offset)
    claims = RequestClaims(redis, stack.redis, worker_id="w", ttl_s=60)
    rids = [f"fin-{uuid.uuid4().hex}" for _ in range(2)]
    for rid, offset in zip(rids, (41, 42), strict=True):
        await claims.claim(rid, f"src:{offset}")
    producer = make_producer(kafka, role="test-txn", transactional_id=f"test-{uuid.uuid4().hex[:6]}")
    await producer.start()
    finalizer = Finalizer(producer, token_topic=kafka.topic(TOPICS.tokens.name),
                          usage_topic=kafka.topic(TOPICS.usage.name), group_id=kafka.group(group),
                          offsets=offsets, claims=claims, batch_max=8)
    loop = asyncio.create_task(finalizer.run())
    try:
        await asyncio.wait_for(asyncio.gather(*(finalizer.finish(finished(rid, source, off, 14))
                                                for rid, off in zip(rids, (41, 42), strict=True))), 20)
    finally:
        await finalizer.stop()
        await loop
        await producer.stop()

    usage = [e for _, _, e, _ in await read_topic(kafka, kafka.topic(TOPICS.usage.name), codec_for(UsageEvent))
             if e.request_id in rids]
    finals = [e for tp, _, e, _ in await read_topic(kafka, kafka.topic(TOPICS.tokens.name), codec_for(TokenEvent))
              if e.request_id in rids and tp.partition == 14]
    assert sorted(e.request_id for e in usage) == sorted(rids)
    assert sorted(e.request_id for e in finals) == sorted(rids)
    # 40 is still generating: the committed offset must stop there, not after 42.
    consumer = make_consumer(kafka, role="test-committed", group=group)
    await consumer.start()
    try:
        assert await consumer.committed(source) == 40
    finally:
        await consumer.stop()
    assert (await claims.claim(rids[0], "src:41")).verdict is ClaimVerdict.DONE


async def test_a_dead_workers_open_transaction_is_never_read(stack: Settings) -> None:
    kafka = stack.kafka
    txn_id = f"zombie-{uuid.uuid4().hex[:6]}"
    rid = f"zombie-{uuid.uuid4().hex}"
    codec = codec_for(UsageEvent)
    zombie = make_producer(kafka, role="zombie", transactional_id=txn_id)
    await zombie.start()
    await zombie.begin_transaction()
    now = utcnow()
    await zombie.send_and_wait(kafka.topic(TOPICS.usage.name), codec.encode(UsageEvent(
        request_id=rid, org_id="o", key_id="k", tier="t", model="m", prompt_tokens=1, completion_tokens=1,
        cached_tokens=0, finish_reason="stop", attempt=1, worker_id="zombie", requested_at=now, started_at=now,
        finished_at=now)), key=rid.encode())
    # The worker "dies" here. Its replacement (same transactional id) fences it and aborts the open transaction.
    successor = make_producer(kafka, role="successor", transactional_id=txn_id)
    await successor.start()
    await successor.stop()
    seen = [e for _, _, e, _ in await read_topic(kafka, kafka.topic(TOPICS.usage.name), codec)
            if e.request_id == rid]
    assert seen == []
    uncommitted = [e for _, _, e, _ in await read_topic(kafka, kafka.topic(TOPICS.usage.name), codec,
                                                        isolation="read_uncommitted") if e.request_id == rid]
    assert len(uncommitted) == 1  # it was written, just never committed
    await asyncio.gather(zombie.stop(), return_exceptions=True)
