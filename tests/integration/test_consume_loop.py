"""The one consumer loop on the real broker: nothing fetched is ever dropped unhandled (defect 1: the paused
branch threw away what a fresh assignment returned), deferred records come back, refused partitions rewind."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from aiokafka import ConsumerRecord, TopicPartition
from aiokafka.admin import NewTopic

from runtime.kafka_clients import consume, make_consumer, make_producer
from runtime.settings import KafkaSettings
from schemas.codec import codec_for
from schemas.errors import RetryLater
from schemas.events import ControlAction, ControlEvent, utcnow
from tests.helpers import scratch_topics, wait_for

pytestmark = pytest.mark.integration
CODEC = codec_for(ControlEvent)


@pytest_asyncio.fixture(loop_scope="session")
async def topic(kafka: KafkaSettings) -> AsyncIterator[str]:
    name = kafka.topic(f"test-consume-{uuid.uuid4().hex[:8]}")
    async with scratch_topics(kafka, NewTopic(name, 2, 1)):
        yield name


async def produce(kafka: KafkaSettings, topic: str, partition: int, n: int) -> list[str]:
    producer = make_producer(kafka, role="test")
    await producer.start()
    ids = [f"r-{partition}-{i}-{uuid.uuid4().hex[:6]}" for i in range(n)]
    try:
        for rid in ids:
            event = ControlEvent(request_id=rid, action=ControlAction.CANCEL, reason="t", issued_by="t",
                                 issued_at=utcnow())
            await producer.send_and_wait(topic, CODEC.encode(event), partition=partition)
    finally:
        await producer.stop()
    return ids


async def test_records_of_a_partition_assigned_while_paused_are_not_lost(kafka: KafkaSettings, topic: str) -> None:
    first, second = TopicPartition(topic, 0), TopicPartition(topic, 1)
    expected = await produce(kafka, topic, 1, 5)
    consumer = make_consumer(kafka, role="test-paused")
    await consumer.start()
    consumer.assign([first])
    await consumer.seek_to_beginning(first)
    room = {"n": 0}
    handled: list[str] = []

    async def handle(event: ControlEvent, _record: ConsumerRecord[bytes, bytes]) -> None:
        handled.append(event.request_id)
        room["n"] -= 1

    stop = asyncio.Event()
    loop = asyncio.create_task(consume(consumer, CODEC, handle, stop=stop, capacity=lambda: room["n"]))
    try:
        await asyncio.sleep(0.3)  # paused: no room
        consumer.assign([first, second])  # as a rebalance would, while the loop is paused
        await consumer.seek_to_beginning(second)
        await asyncio.sleep(1.5)  # the paused loop keeps polling; the new partition is not paused yet
        room["n"] = 100
        assert await wait_for(lambda: len(handled) == 5, timeout_s=10)
        assert handled == expected
    finally:
        stop.set()
        await loop
        await consumer.stop()


async def test_a_deferred_record_is_handled_again_and_a_refused_partition_rewinds(kafka: KafkaSettings,
                                                                                 topic: str) -> None:
    expected = await produce(kafka, topic, 0, 4)
    tp = TopicPartition(topic, 0)
    consumer = make_consumer(kafka, role="test-defer")
    await consumer.start()
    consumer.assign([tp])
    await consumer.seek_to_beginning(tp)
    handled: list[str] = []
    attempts: dict[str, int] = {}
    open_ = {"accept": False}

    async def handle(event: ControlEvent, _record: ConsumerRecord[bytes, bytes]) -> None:
        attempts[event.request_id] = attempts.get(event.request_id, 0) + 1
        if event.request_id == expected[1] and attempts[event.request_id] == 1:
            raise RetryLater("a store is down", 0.05)
        handled.append(event.request_id)

    stop = asyncio.Event()
    loop = asyncio.create_task(consume(consumer, CODEC, handle, stop=stop, accepts=lambda _tp: open_["accept"]))
    try:
        await asyncio.sleep(0.5)
        assert handled == []  # refused partition: rewound, nothing handled, nothing skipped
        open_["accept"] = True
        assert await wait_for(lambda: len(handled) == 4, timeout_s=10)
        assert handled == expected and attempts[expected[1]] == 2
    finally:
        stop.set()
        await loop
        await consumer.stop()
