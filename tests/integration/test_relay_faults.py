"""The relay on a real reply partition when events cannot be read: the request ends at once with an error (its
record key says which), the record is dead-lettered, and the other streams go on."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable

import pytest

from producers.relay.demux import Relay
from runtime.dead_letters import DeadLetters
from runtime.kafka_clients import make_producer
from runtime.settings import KafkaSettings
from schemas.codec import MAGIC, codec_for
from schemas.events import TokenEvent, TokenUsage
from schemas.topics import TOPICS
from tests.helpers import read_topic, wait_for

pytestmark = pytest.mark.integration
PARTITION = 13


async def _by(processor: bytes, rows: Awaitable[list]) -> list:
    return [row[:2] for row in await rows if row[2]["processor"] == processor]


class Raw:
    @staticmethod
    def decode(value: bytes) -> bytes:
        return value


async def test_an_undecodable_token_event_ends_its_stream_at_once_and_is_dead_lettered(kafka: KafkaSettings) -> None:
    topic = kafka.topic(TOPICS.tokens.name)
    producer = make_producer(kafka, role="test")
    await producer.start()
    relay = Relay(kafka, topic, PARTITION, DeadLetters(producer, kafka, "gateway"))
    await relay.start()
    try:
        broken, fine = relay.register("req-broken"), relay.register("req-fine")
        future = MAGIC + bytes.fromhex("fedcba9876543210") + b"a newer worker's token event"
        await producer.send_and_wait(topic, future, key=b"req-broken", partition=PARTITION)
        final = TokenEvent(request_id="req-fine", attempt=1, seq=0, token_offset=0, token_ids=[5], text="ok",
                           finish_reason="stop", usage=TokenUsage(prompt_tokens=1, completion_tokens=1),
                           worker_id="w", emitted_at_us=time.time_ns() // 1000)
        await producer.send_and_wait(topic, codec_for(TokenEvent).encode(final), key=b"req-fine", partition=PARTITION)
        delta = await asyncio.wait_for(broken.get(), 10)
        assert (delta.finish_reason, delta.error_code, delta.from_worker) == ("error", "undecodable_event", False)
        other = await asyncio.wait_for(fine.get(), 10)
        assert (other.text, other.finish_reason) == ("ok", "stop")

        async def dead_lettered() -> list:  # type: ignore[type-arg]
            rows = await read_topic(kafka, kafka.topic(TOPICS.dead_letter.name), Raw)  # type: ignore[arg-type]
            return [(tp.partition, offset, dict(h)) for tp, offset, value, h in rows if value == future]

        # Each service that cannot read the record dead-letters it under its own name: the safety processor's
        # output moderation reads this topic too, when the session's processors run and hold the partition.
        found = await wait_for(lambda: _by(b"gateway", dead_lettered()), timeout_s=10)
        assert len(found) == 1, f"dead-lettered once by the gateway, found at (partition, offset): {found}"
        ((_, _, headers),) = [f for f in await dead_lettered() if f[2]["processor"] == b"gateway"]
        assert headers["source-partition"] == str(PARTITION).encode() and headers["source-offset"] == b"0"
    finally:
        await relay.stop()
        await producer.stop()
