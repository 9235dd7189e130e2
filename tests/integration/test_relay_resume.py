"""Resuming a stream on the relay (real Kafka): from another gateway's partition or this one's, from an offset the
feed has passed (a rewind), each delta once, in order, the client's part skipped, live events after the backlog."""

from __future__ import annotations

import asyncio

import pytest

from producers.relay.demux import Relay
from runtime.kafka_clients import make_producer
from runtime.settings import KafkaSettings
from schemas.codec import codec_for
from schemas.events import TokenEvent
from schemas.topics import TOPICS
from tests.helpers import drain_stream as drain
from tests.helpers import token_event as token
from tests.helpers import wait_for

pytestmark = pytest.mark.integration
OWN, OTHER = 13, 14


async def test_a_stream_resumes_from_another_partition_with_backlog_then_live_events(kafka: KafkaSettings) -> None:
    topic = kafka.topic(TOPICS.tokens.name)
    codec = codec_for(TokenEvent)
    producer = make_producer(kafka, role="test")
    await producer.start()
    relay = Relay(kafka, topic, OWN)
    await relay.start()
    try:
        first = (await producer.send_and_wait(topic, codec.encode(token("r1", 0)), key=b"r1", partition=OTHER)).offset
        for seq in (1, 2, 3):
            await producer.send_and_wait(topic, codec.encode(token("r1", seq)), key=b"r1", partition=OTHER)
            await producer.send_and_wait(topic, codec.encode(token("noise", seq)), key=b"noise", partition=OTHER)
        # The client had deltas 1 and 2 (positions are 1-based: 0 is the stream's start).
        collector = await relay.resume("r1", OTHER, first, skip_through=2)
        await wait_for(lambda: collector.accepted == 4, timeout_s=10, interval_s=0.01,
                       what="the backlog read (deltas 0-3)")  # what follows comes live
        for seq in (4, 5):
            await producer.send_and_wait(topic, codec.encode(token("r1", seq, final=seq == 5)), key=b"r1",
                                         partition=OTHER)
        text, last = await drain(collector)
        assert text == "<2><3><4><5>" and last.position == 6 and last.finish_reason == "stop"
        assert collector.duplicates == 0
    finally:
        await relay.stop()
        await producer.stop()


async def test_a_resume_behind_the_feed_rewinds_it_without_repeating_events_to_open_streams(
        kafka: KafkaSettings) -> None:
    topic = kafka.topic(TOPICS.tokens.name)
    codec = codec_for(TokenEvent)
    producer = make_producer(kafka, role="test")
    await producer.start()
    relay = Relay(kafka, topic, OWN)
    await relay.start()
    try:
        # A stream accepted by an earlier life of this gateway, on its own partition: before the relay's start.
        early = (await producer.send_and_wait(topic, codec.encode(token("old", 0)), key=b"old", partition=OWN)).offset
        await producer.send_and_wait(topic, codec.encode(token("old", 1)), key=b"old", partition=OWN)
        await relay.stop()
        relay = Relay(kafka, topic, OWN)
        await relay.start()
        live = relay.register("live")
        await producer.send_and_wait(topic, codec.encode(token("live", 0)), key=b"live", partition=OWN)
        await asyncio.wait_for(live.get(), 10)
        resumed = await relay.resume("old", OWN, early, skip_through=0)  # rewinds the feed to `early`
        for seq, final in ((1, False), (2, True)):
            await producer.send_and_wait(topic, codec.encode(token("live", seq, final=final)), key=b"live",
                                         partition=OWN)
        await producer.send_and_wait(topic, codec.encode(token("old", 2, final=True)), key=b"old", partition=OWN)
        text, _ = await drain(resumed)
        assert text == "<0><1><2>"
        rest, _ = await drain(live)
        assert rest == "<1><2>" and live.duplicates == 0  # the rewind re-read <0> of "live": not routed again
    finally:
        await relay.stop()
        await producer.stop()
