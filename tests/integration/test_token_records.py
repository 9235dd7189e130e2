"""Token records on the real broker: the worker's sink packs one step's deltas of many requests into one record
per reply partition; the relay hands each delta to its stream in order, a resume counts the same positions, and a
takeover's prefix read finds a request's deltas among the others'."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from aiokafka import AIOKafkaProducer, TopicPartition

from inference_workers.prefix import PrefixReader
from inference_workers.token_sink import TokenSink
from producers.relay.demux import Relay
from runtime.kafka_clients import make_consumer, make_producer
from runtime.settings import KafkaSettings
from schemas.codec import codec_for
from schemas.events import TokenEvent
from schemas.topics import TOPICS
from tests.fakes.worker import request
from tests.helpers import drain_stream as drain
from tests.helpers import token_event as token
from tests.helpers import wait_for

pytestmark = pytest.mark.integration
OWN, OTHER = 11, 12


@pytest_asyncio.fixture(loop_scope="session")
async def producer(kafka: KafkaSettings) -> AsyncIterator[AIOKafkaProducer]:
    producer = make_producer(kafka, role="test-token-records")
    await producer.start()
    yield producer
    await producer.stop()


async def _step(sink: TokenSink, partition: int, events: list[TokenEvent]) -> list[asyncio.Future[object]]:
    """One engine step: every delta emitted in one turn of the loop, then acknowledged."""
    deliveries = [await sink.emit(event, partition, None) for event in events]
    return list(await asyncio.gather(*deliveries))


async def _records(kafka: KafkaSettings, partition: int, start: int) -> int:
    tp = TopicPartition(kafka.topic(TOPICS.tokens.name), partition)
    consumer = make_consumer(kafka, role="test-count")
    await consumer.start()
    try:
        return (await consumer.end_offsets([tp]))[tp] - start
    finally:
        await consumer.stop()


async def test_packed_records_reach_each_stream_in_order(kafka: KafkaSettings, producer: AIOKafkaProducer) -> None:
    topic = kafka.topic(TOPICS.tokens.name)
    sink = TokenSink(producer, topic)
    relay = Relay(kafka, topic, OWN)
    await relay.start()
    try:
        start = relay.position
        a, b = relay.register("pack-a"), relay.register("pack-b")
        acks = []
        for seq in range(4):
            # "gone" is a request whose client left: its deltas share the records and are dropped
            acks += await _step(sink, OWN, [token("pack-a", seq), token("gone", seq), token("pack-b", seq)])
        # a request that emitted twice before its step's record left: two of its deltas in one record
        acks += await _step(sink, OWN, [token("pack-a", 4), token("pack-b", 4), token("pack-a", 5)])
        for rid, last in (("pack-a", 6), ("pack-b", 5)):  # finals ride alone (the worker's commit transaction)
            await producer.send_and_wait(topic, codec_for(TokenEvent).encode(token(rid, last, final=True)),
                                         key=rid.encode(), partition=OWN)
        (text_a, last_a), (text_b, last_b) = await asyncio.gather(drain(a), drain(b))
        assert text_a == "".join(f"<{i}>" for i in range(7)) and last_a.position == 7
        assert text_b == "".join(f"<{i}>" for i in range(6)) and last_b.position == 6
        assert a.duplicates == b.duplicates == 0
        assert len({ack.offset for ack in acks}) == 5  # type: ignore[attr-defined]  # one record per step
        assert await _records(kafka, OWN, start) == 5 + 2
    finally:
        await relay.stop()


async def test_a_resume_counts_positions_across_packed_records(kafka: KafkaSettings,
                                                               producer: AIOKafkaProducer) -> None:
    topic = kafka.topic(TOPICS.tokens.name)
    sink = TokenSink(producer, topic)
    relay = Relay(kafka, topic, OWN)
    await relay.start()
    try:
        first = (await _step(sink, OTHER, [token("other", 0), token("resumed", 0)]))[0].offset  # type: ignore[attr-defined]
        for seq in (1, 2, 3):
            await _step(sink, OTHER, [token("resumed", seq), token("other", seq)])
        collector = await relay.resume("resumed", OTHER, first, skip_through=2)  # the client had deltas 1 and 2
        await wait_for(lambda: collector.accepted == 4, timeout_s=10, interval_s=0.01,
                       what="the backlog read (deltas 0-3)")  # what follows comes live
        await _step(sink, OTHER, [token("other", 4), token("resumed", 4)])
        await producer.send_and_wait(topic, codec_for(TokenEvent).encode(token("resumed", 5, final=True)),
                                     key=b"resumed", partition=OTHER)
        text, last = await drain(collector)
        assert text == "<2><3><4><5>" and last.position == 6 and collector.duplicates == 0
    finally:
        await relay.stop()


async def test_a_takeover_reads_its_requests_deltas_out_of_packed_records(kafka: KafkaSettings,
                                                                          producer: AIOKafkaProducer) -> None:
    topic = kafka.topic(TOPICS.tokens.name)
    sink = TokenSink(producer, topic)
    req = request(max_tokens=10, reply=OTHER).model_copy(update={"request_id": f"chatcmpl-{uuid.uuid4().hex}"})
    rid = req.request_id
    first = None
    for seq in range(3):
        acks = await _step(sink, OTHER, [token("neighbour", seq), token(rid, seq, f"w{seq}")])
        first = acks[0].offset if first is None else first  # type: ignore[attr-defined]
    await _step(sink, OTHER, [token("neighbour", 3)])  # a record without it
    await _step(sink, OTHER, [token(rid, 3, "w3")])  # a record of it alone (keyed)
    reader = PrefixReader(kafka, topic)
    await reader.start()
    try:
        for start in (first, None):  # from its first offset, and by time when that offset is unknown
            prefix = await reader.read(req, start)
            assert (prefix.token_ids, prefix.text, prefix.attempt) == ([0, 1, 2, 3], "w0w1w2w3", 1)
    finally:
        await reader.stop()
