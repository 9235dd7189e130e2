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

    # The rebalance comes while the loop has no room, between its pause and its poll (aiokafka assigns in the
    # background; the poll then fetches from every assigned partition not paused): that poll returns the new
    # partition's records, which the paused branch must put back (defect 1 dropped them).
    fetched_while_paused: list[int] = []
    getmany = consumer.getmany

    async def rebalanced_before_the_poll(*partitions: TopicPartition, **options: object
                                         ) -> dict[TopicPartition, list[object]]:
        if room["n"] <= 0 and not fetched_while_paused:
            consumer.assign([first, second])
            await consumer.seek_to_beginning(second)
            options = {**options, "timeout_ms": 10_000}  # until the new partition's records are in
        batches = await getmany(*partitions, **options)  # type: ignore[arg-type]
        if room["n"] <= 0 and batches.get(second):
            fetched_while_paused.append(len(batches[second]))
        return batches  # type: ignore[return-value]

    consumer.getmany = rebalanced_before_the_poll  # type: ignore[method-assign]
    stop = asyncio.Event()
    loop = asyncio.create_task(consume(consumer, CODEC, handle, stop=stop, capacity=lambda: room["n"]))
    try:
        await wait_for(lambda: fetched_while_paused, timeout_s=15, interval_s=0.02,
                       what="a poll of the paused loop returned the new partition's records")
        assert handled == []
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

    refusals = {"n": 0}

    def accepts(_tp: TopicPartition) -> bool:
        refusals["n"] += not open_["accept"]
        return open_["accept"]

    stop = asyncio.Event()
    loop = asyncio.create_task(consume(consumer, CODEC, handle, stop=stop, accepts=accepts))
    try:
        # fetched and refused twice: the second fetch found the records again (rewound, not skipped)
        await wait_for(lambda: refusals["n"] >= 2, timeout_s=10, interval_s=0.02, what="two refused fetches")
        assert handled == []  # refused partition: nothing handled
        open_["accept"] = True
        assert await wait_for(lambda: len(handled) == 4, timeout_s=10)
        assert handled == expected and attempts[expected[1]] == 2
    finally:
        stop.set()
        await loop
        await consumer.stop()
