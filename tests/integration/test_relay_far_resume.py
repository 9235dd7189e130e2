"""A far resume on the relay (real Kafka, issue 37 M2): it reads its backlog on a consumer of its own, so the feed of
resumed streams never goes back for it; once caught up it joins that feed, and its consumer stops when it is done
or its client leaves."""

from __future__ import annotations

import asyncio

import pytest
from aiokafka import ConsumerRecord

from producers.relay import demux
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
#: a partition of the token topic of its own (other relay tests use 9 to 14)
PARTITION = 15
BACKLOG = 1000


async def test_a_far_resume_does_not_delay_another_resumed_stream_of_its_partition(
        kafka: KafkaSettings, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, a resume behind the partition's feed of resumed streams rewound that feed: every other resumed stream
    of the partition (another tenant's, resumed after its gateway died) got nothing new until the feed had read the
    whole backlog again (up to the resume window, 15 min, of the partition; repeated by a client that resumes and
    drops at will). Here the far stream's backlog is held half-way while the other resumed stream's next token must
    arrive: no time bound decides it."""
    monkeypatch.setattr(demux, "NEAR_REWIND", 100, raising=False)
    topic = kafka.topic(TOPICS.tokens.name)
    codec = codec_for(TokenEvent)
    producer = make_producer(kafka, role="test")
    await producer.start()
    try:
        far_first = (await producer.send_and_wait(topic, codec.encode(token("far", 0)), key=b"far",
                                                  partition=PARTITION)).offset
        noise = codec.encode(token("someone-else", 0))
        sends = [await producer.send(topic, noise, key=b"someone-else", partition=PARTITION) for _ in range(BACKLOG)]
        backlog_end = (await asyncio.gather(*sends))[-1].offset + 1
        near_first = (await producer.send_and_wait(topic, codec.encode(token("near", 0)), key=b"near",
                                                   partition=PARTITION)).offset
        held, released = asyncio.Event(), asyncio.Event()
        route = demux._Feed._route

        async def slow_backlog(feed: demux._Feed, record: ConsumerRecord[bytes, bytes]) -> None:
            if far_first < record.offset < backlog_end:  # the far stream's backlog: held
                held.set()
                await released.wait()
            await route(feed, record)

        monkeypatch.setattr(demux._Feed, "_route", slow_backlog)
        relay = Relay(kafka, topic, PARTITION)
        await relay.start()
        try:
            near = await relay.resume("near", PARTITION, near_first, skip_through=0)  # opens the resumed feed here
            assert (await asyncio.wait_for(near.get(), 20)).text == "<0>"
            far = await relay.resume("far", PARTITION, far_first, skip_through=0)  # 1000 records behind it
            await wait_for(held.is_set, timeout_s=20, interval_s=0.01, what="the far stream's backlog being read")
            await producer.send_and_wait(topic, codec.encode(token("near", 1, final=True)), key=b"near",
                                         partition=PARTITION)
            text, last = await drain(near, 20)  # TimeoutError: it waits behind the far stream's backlog
            assert (text, last.finish_reason) == ("<1>", "stop")
            released.set()
            assert (await asyncio.wait_for(far.get(), 60)).text == "<0>"
            await wait_for(lambda: not relay._catch_ups, timeout_s=30, interval_s=0.01,
                           what="the far stream handed to the feed of resumed streams, its own consumer stopped")
            await producer.send_and_wait(topic, codec.encode(token("far", 1, final=True)), key=b"far",
                                         partition=PARTITION)
            text, last = await drain(far, 20)
            assert (text, last.finish_reason) == ("<1>", "stop") and far.duplicates == 0
        finally:
            released.set()
            await relay.stop()
    finally:
        await producer.stop()


async def test_a_far_resume_whose_client_left_stops_and_the_resumed_feed_never_goes_back(
        kafka: KafkaSettings, monkeypatch: pytest.MonkeyPatch) -> None:
    """A client that resumes far back and drops at once (a loop of them) costs a short-lived consumer, not a replay
    of the partition on the feed other resumed streams share."""
    monkeypatch.setattr(demux, "NEAR_REWIND", 100, raising=False)
    topic = kafka.topic(TOPICS.tokens.name)
    codec = codec_for(TokenEvent)
    producer = make_producer(kafka, role="test")
    await producer.start()
    relay = Relay(kafka, topic, PARTITION)
    shared_feed_read: list[int] = []
    route = demux._Feed._route

    async def watched(feed: demux._Feed, record: ConsumerRecord[bytes, bytes]) -> None:
        if feed is not relay._own and not isinstance(feed, getattr(demux, "_CatchUp", ())):
            shared_feed_read.append(record.offset)
        await route(feed, record)

    monkeypatch.setattr(demux._Feed, "_route", watched)
    try:
        old = (await producer.send_and_wait(topic, codec.encode(token("gone", 0)), key=b"gone",
                                            partition=PARTITION)).offset
        noise = codec.encode(token("someone-else", 0))
        sends = [await producer.send(topic, noise, key=b"someone-else", partition=PARTITION) for _ in range(BACKLOG)]
        await asyncio.gather(*sends)
        live = (await producer.send_and_wait(topic, codec.encode(token("live", 0)), key=b"live",
                                             partition=PARTITION)).offset
        await relay.start()
        resumed = await relay.resume("live", PARTITION, live, skip_through=0)
        assert (await asyncio.wait_for(resumed.get(), 20)).text == "<0>"
        for _ in range(3):
            await relay.resume("gone", PARTITION, old, skip_through=0)
            relay.unregister("gone")  # its client left at once
        await wait_for(lambda: not getattr(relay, "_catch_ups", ()), timeout_s=10, interval_s=0.01,
                       what="the far resumes' consumers stopped")
        await producer.send_and_wait(topic, codec.encode(token("live", 1, final=True)), key=b"live",
                                     partition=PARTITION)
        text, _ = await drain(resumed, 20)
        assert text == "<1>"
        assert min(shared_feed_read) >= live, "the feed of resumed streams went back for a far resume"
    finally:
        await relay.stop()
        await producer.stop()


async def test_far_resumes_past_the_catch_up_turns_wait_for_one(kafka: KafkaSettings,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Each far resume reading its backlog is a consumer decoding its partition: a gateway process runs
    ``MAX_CATCH_UPS`` at once, and another far resume waits for a turn (here: one turn, held by a first one)."""
    monkeypatch.setattr(demux, "NEAR_REWIND", 100)
    monkeypatch.setattr(demux, "MAX_CATCH_UPS", 1)
    topic = kafka.topic(TOPICS.tokens.name)
    codec = codec_for(TokenEvent)
    producer = make_producer(kafka, role="test")
    await producer.start()
    try:
        noise = codec.encode(token("someone-else", 0))

        async def backlog() -> int:
            sends = [await producer.send(topic, noise, key=b"someone-else", partition=PARTITION) for _ in range(500)]
            return (await asyncio.gather(*sends))[-1].offset

        first = (await producer.send_and_wait(topic, codec.encode(token("first", 0)), key=b"first",
                                              partition=PARTITION)).offset
        held_from = await backlog() - 499
        second = (await producer.send_and_wait(topic, codec.encode(token("second", 0, final=True)), key=b"second",
                                               partition=PARTITION)).offset
        await backlog()
        live = (await producer.send_and_wait(topic, codec.encode(token("live", 0)), key=b"live",
                                             partition=PARTITION)).offset
        held, released = asyncio.Event(), asyncio.Event()
        route = demux._Feed._route

        async def slow_first_backlog(feed: demux._Feed, record: ConsumerRecord[bytes, bytes]) -> None:
            if held_from <= record.offset < second:
                held.set()
                await released.wait()
            await route(feed, record)

        monkeypatch.setattr(demux._Feed, "_route", slow_first_backlog)
        relay = Relay(kafka, topic, PARTITION)
        await relay.start()
        try:
            await relay.resume("live", PARTITION, live, skip_through=0)
            await relay.resume("first", PARTITION, first, skip_through=0)
            await wait_for(held.is_set, timeout_s=20, interval_s=0.01, what="the first far resume's backlog held")
            waiting = asyncio.ensure_future(relay.resume("second", PARTITION, second, skip_through=0))
            for _ in range(20):
                await asyncio.sleep(0)
            assert not waiting.done() and len(relay._catch_ups) == 1  # the one turn is the first's
            relay.unregister("first")  # its client leaves: its turn ends with its fetch
            released.set()
            resumed = await asyncio.wait_for(waiting, 20)
            text, last = await drain(resumed, 20)
            assert (text, last.finish_reason) == ("<0>", "stop")
        finally:
            released.set()
            await relay.stop()
    finally:
        await producer.stop()
