"""Adversarial review of the priority gate (f1179e9) on the real broker: the gate's reads of aiokafka state across
an await (a rebalance moves a partition while the end-offset lookup is in flight), and lag under read_committed
(the high watermark counts records a read_committed consumer cannot fetch)."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from aiokafka import TopicPartition
from aiokafka.admin import NewTopic

from inference_workers.priority import WINDOW, PriorityGate
from runtime.kafka_clients import all_partitions, make_consumer, make_producer
from runtime.settings import KafkaSettings
from tests.helpers import scratch_topics, wait_for

pytestmark = pytest.mark.integration
RANKS = {"high": 0, "standard": 1, "low": 2}


@pytest_asyncio.fixture(loop_scope="session")
async def queues(kafka: KafkaSettings) -> AsyncIterator[tuple[str, str]]:
    run = uuid.uuid4().hex[:8]
    high, low = kafka.topic(f"test-prio-high-{run}"), kafka.topic(f"test-prio-low-{run}")
    async with scratch_topics(kafka, NewTopic(high, 2, 1), NewTopic(low, 1, 1)):
        probe = make_consumer(kafka, role="test-prio-probe")
        await probe.start()
        try:  # the topics are in the metadata before a test assigns them
            await all_partitions(probe, high)
            await all_partitions(probe, low)
        finally:
            await probe.stop()
        yield high, low


async def _produce(kafka: KafkaSettings, topic: str, partition: int, n: int) -> None:
    producer = make_producer(kafka, role="test-prio")
    await producer.start()
    try:
        for i in range(n):
            await producer.send_and_wait(topic, f"r{i}".encode(), partition=partition)
    finally:
        await producer.stop()


async def _stop(consumer: object) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(consumer.stop(), 10)  # type: ignore[attr-defined]


async def test_a_rebalance_during_the_end_offset_lookup_does_not_crash_the_gate(kafka: KafkaSettings,
                                                                                queues: tuple[str, str]) -> None:
    """select() reads ``consumer.highwater(tp)`` for the partitions it listed *before* awaiting end_offsets();
    aiokafka asserts a partition is assigned, so a rebalance that moves one away meanwhile raises AssertionError
    out of select() -> out of consume() -> the request consumer task dies (the worker stops). report_depth() only
    catches KafkaError/IllegalStateError, so its loop dies silently and the queue-depth gauge freezes."""
    high, low = queues
    h0, h1, lo = TopicPartition(high, 0), TopicPartition(high, 1), TopicPartition(low, 0)
    await _produce(kafka, high, 0, 1)
    consumer = make_consumer(kafka, role="test-prio-race")
    await consumer.start()
    try:
        consumer.assign([h0, h1, lo])
        await consumer.seek_to_beginning(h0, h1, lo)
        await consumer.getmany(timeout_ms=1000)  # fetched once: highwater known for the unpaused partitions
        consumer.pause(lo)  # a lower class paused by the gate: its end is looked up
        real_end_offsets = consumer.end_offsets

        async def end_offsets_during_a_rebalance(tps: list[TopicPartition]) -> dict[TopicPartition, int]:
            ends = await real_end_offsets(tps)
            consumer.assign([h1, lo])  # the group moved h0 to another worker while the lookup was in flight
            return ends

        consumer.end_offsets = end_offsets_during_a_rebalance
        gate = PriorityGate(consumer, {high: "high", low: "low"}, RANKS, min_share=0.1, refresh_s=0.0)
        selected = await gate.select()  # AssertionError: Partition is not assigned
        assert h0 not in selected
    finally:
        await _stop(consumer)


async def test_the_depth_loop_survives_a_rebalance_during_its_lookup(kafka: KafkaSettings,
                                                                     queues: tuple[str, str]) -> None:
    high, low = queues
    h0, h1, lo = TopicPartition(high, 0), TopicPartition(high, 1), TopicPartition(low, 0)
    consumer = make_consumer(kafka, role="test-prio-depth")
    await consumer.start()
    try:
        consumer.assign([h0, h1, lo])
        await consumer.seek_to_beginning(h0, h1, lo)
        await consumer.getmany(timeout_ms=1000)
        consumer.pause(lo)
        real_end_offsets = consumer.end_offsets
        moved = {"done": False}
        lookups = {"n": 0}

        async def end_offsets_during_a_rebalance(tps: list[TopicPartition]) -> dict[TopicPartition, int]:
            lookups["n"] += 1
            ends = await real_end_offsets(tps)
            if not moved["done"]:
                moved["done"] = True
                consumer.assign([h1, lo])
            return ends

        consumer.end_offsets = end_offsets_during_a_rebalance
        gate = PriorityGate(consumer, {high: "high", low: "low"}, RANKS, min_share=0.1, refresh_s=0.0)
        loop = asyncio.create_task(gate.report_depth(every_s=0.05))
        # two more reports after the one the rebalance hit: it survived it and went on
        await wait_for(lambda: lookups["n"] >= 3 or loop.done(), timeout_s=20, interval_s=0.02,
                       what="three end-offset lookups")
        try:
            assert not loop.done(), f"the queue-depth loop died: {loop.exception()!r}"
        finally:
            loop.cancel()
            await asyncio.gather(loop, return_exceptions=True)
    finally:
        await _stop(consumer)


async def test_records_of_an_open_transaction_are_not_counted_as_waiting_under_read_committed(
        kafka: KafkaSettings, queues: tuple[str, str]) -> None:
    """Latent (no transactional writer to the work queues today): for a fetched (unpaused) partition the gate uses
    ``highwater()``, the high watermark, but the worker's consumer is read_committed and can read only up to the
    last stable offset. An open (or hanging) transaction on a high partition then reads as requests waiting that
    no fetch returns: the lower classes stay paused once they had their share, and since nothing is admitted the
    shares never change (the guard counts admissions, not time). DEVELOPERS.md says the gate uses the LSO."""
    high, low = queues
    h0, lo = TopicPartition(high, 0), TopicPartition(low, 0)
    consumer = make_consumer(kafka, role="test-prio-lso")  # read_committed, as the worker's
    await consumer.start()
    txn = make_producer(kafka, role="test-prio-txn", transactional_id=f"test-prio-{uuid.uuid4().hex[:8]}")
    await txn.start()
    try:
        consumer.assign([h0, lo])
        await consumer.seek_to_end(h0, lo)
        await consumer.position(h0)
        await consumer.position(lo)
        await txn.begin_transaction()
        await txn.send_and_wait(high, b"not committed yet", partition=0)  # open: not readable (read_committed)
        await _produce(kafka, low, 0, 3)
        for _ in range(5):
            assert (await consumer.getmany(h0, timeout_ms=300)).get(h0) is None
        assert consumer.highwater(h0) is not None and consumer.highwater(h0) > await consumer.position(h0)
        gate = PriorityGate(consumer, {high: "high", low: "low"}, RANKS, min_share=0.1, refresh_s=0.0)
        for _ in range(WINDOW):
            gate.admitted(lo)  # the low class had the engine before
        waiting = await gate.waiting(consumer.assignment())
        assert waiting[h0] == 0, "an uncommitted record counted as a request waiting"
        assert lo in await gate.select()
    finally:
        if txn._txn_manager.is_in_transaction():  # aiokafka has no public accessor
            await txn.abort_transaction()
        await txn.stop()
        await _stop(consumer)
