"""The relay on a real reply partition: per-request routing, order, duplicates, unknown ids, start at the end."""

from __future__ import annotations

import asyncio

import pytest

from producers.relay.demux import Relay
from runtime.kafka_clients import make_producer
from runtime.settings import KafkaSettings
from schemas.codec import codec_for
from schemas.events import TokenEvent
from schemas.topics import TOPICS
from tests.helpers import token_event as token
from tests.helpers import wait_for

pytestmark = pytest.mark.integration
PARTITION = 15


async def test_relay_routes_each_request_its_own_tokens_in_order(kafka: KafkaSettings) -> None:
    topic = kafka.topic(TOPICS.tokens.name)
    codec = codec_for(TokenEvent)
    producer = make_producer(kafka, role="test")
    await producer.start()
    # Written before the relay starts: belongs to a previous gateway life, must not be routed.
    await producer.send_and_wait(topic, codec.encode(token("old", 0, "stale")), partition=PARTITION)
    relay = Relay(kafka, topic, PARTITION)
    await relay.start()
    try:
        a, b = relay.register("req-a"), relay.register("req-b")
        old = relay.register("old")
        words = {"req-a": ["The", " capital", " of", " France"], "req-b": ["1", "2", "3", "4"]}
        for i in range(4):  # interleaved, as two generations in one batch would be
            for rid in ("req-a", "req-b"):
                await producer.send(topic, codec.encode(token(rid, i, words[rid][i], final=i == 3)),
                                    key=rid.encode(), partition=PARTITION)
        await producer.send(topic, codec.encode(token("req-a", 1, " capital")), partition=PARTITION)  # duplicate
        await producer.send(topic, codec.encode(token("nobody", 0, "x")), partition=PARTITION)
        await producer.flush()

        async def collect(collector) -> str:  # type: ignore[no-untyped-def]
            text = ""
            while True:
                delta = await collector.get()
                text += delta.text
                if delta.finished:
                    return text

        texts = await asyncio.wait_for(asyncio.gather(collect(a), collect(b)), 10)
        assert texts == ["The capital of France", "1234"]
        assert not old._ready.is_set()  # the record from before start() was not routed
    finally:
        await relay.stop()
        await producer.stop()


async def test_stopping_the_relay_ends_open_streams(kafka: KafkaSettings) -> None:
    relay = Relay(kafka, kafka.topic(TOPICS.tokens.name), PARTITION)
    await relay.start()
    collector = relay.register("open")
    await relay.stop()
    delta = await asyncio.wait_for(collector.get(), 5)
    assert delta.finish_reason == "error" and "shutting down" in (delta.error or "")


async def test_a_client_that_never_reads_does_not_hold_back_the_others(kafka: KafkaSettings) -> None:
    topic = kafka.topic(TOPICS.tokens.name)
    codec = codec_for(TokenEvent)
    relay = Relay(kafka, topic, PARTITION)
    await relay.start()
    producer = make_producer(kafka, role="test")
    await producer.start()
    try:
        slow, fast = relay.register("slow-reader"), relay.register("fast-reader")
        n = 2000
        for i in range(n):
            slow_event = token("slow-reader", i, "s", final=i == n - 1)
            await producer.send(topic, codec.encode(slow_event), partition=PARTITION)
            if i % 100 == 0:
                await producer.send(topic, codec.encode(token("fast-reader", i // 100, "f", final=i == n - 100)),
                                    partition=PARTITION)
        await producer.flush()
        text = ""
        while True:  # the fast reader gets everything while nobody reads the slow stream
            delta = await asyncio.wait_for(fast.get(), 10)
            text += delta.text
            if delta.finished:
                break
        assert text == "f" * 20
        # ... and nothing of the slow stream was dropped: it is all merged in its slot. Its final is the last record
        # written, so once the relay has put it, everything before it has been put too.
        assert await wait_for(lambda: slow.finished, timeout_s=10), "the relay never routed the slow stream's final"
        backlog = await asyncio.wait_for(slow.get(), 5)
        assert (backlog.text, backlog.token_count, backlog.finish_reason) == ("s" * n, n, "stop")
    finally:
        await producer.stop()
        await relay.stop()
