"""On the real broker: a takeover's prefix read when Redis lost the request's first offset and the previous
worker's clock runs behind the gateway's (an adversarial review's finding; failed before the token topic used the
broker's clock).

Run with KNS_TEST_PORT_BASE set (see DEVELOPERS / the review report); needs only Kafka."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import timedelta

import pytest
import pytest_asyncio
from aiokafka.admin import NewTopic

from inference_workers.prefix import PrefixReader
from runtime.kafka_clients import make_producer
from runtime.settings import KafkaSettings, Settings
from schemas.codec import codec_for
from schemas.events import TokenEvent
from schemas.topics import TOPICS
from tests.fakes.worker import request
from tests.helpers import scratch_topics

pytestmark = pytest.mark.integration


@pytest_asyncio.fixture(loop_scope="session")
async def token_topic(settings: Settings) -> AsyncIterator[tuple[KafkaSettings, str]]:
    kafka = settings.kafka
    name = kafka.topic(f"test-review-prefix-{uuid.uuid4().hex[:8]}")
    async with scratch_topics(kafka, NewTopic(name, 1, 1, topic_configs=TOPICS.tokens.configs())):  # as provisioned
        yield kafka, name


async def test_a_prefix_read_by_time_finds_the_events_of_a_worker_whose_clock_is_behind(
        token_topic: tuple[KafkaSettings, str]) -> None:
    """Promises 1/2. prefix.py:88-93: without the first offset (Redis restarted without persistence, or the
    hsetnx after the first ack failed), the takeover searches the reply partition with offsets_for_times from
    ``created_at - 5 s`` - the *gateway's* clock - while the records carry the *worker's* CreateTime (topics use
    the default message.timestamp.type). A worker 10 s behind stamps every event of the request before the
    search point: the takeover sees nothing emitted, so it restarts the generation from token 0 (a splice or
    stream_inconsistent for an unseeded sample; with a Redis-lost claim even attempt 1 again), or, past the
    queue deadline, refuses the request with queue_deadline_exceeded and bills nothing, though the client has
    3 tokens."""
    kafka, topic = token_topic
    req = request(max_tokens=8, reply=0)
    codec = codec_for(TokenEvent)
    behind_ms = int((req.created_at - timedelta(seconds=10)).timestamp() * 1000)
    producer = make_producer(kafka, role="review-skewed-worker")
    await producer.start()
    try:
        for seq in range(3):
            event = TokenEvent(request_id=req.request_id, attempt=1, seq=seq, token_offset=seq,
                               token_ids=[1000 + seq], text=f" t{1000 + seq}", worker_id="w-behind",
                               emitted_at_us=0)
            await producer.send_and_wait(topic, codec.encode(event), key=req.request_id.encode(), partition=0,
                                         timestamp_ms=behind_ms + seq * 50)
    finally:
        await producer.stop()

    reader = PrefixReader(kafka, topic, timeout_s=20)
    await reader.start()
    try:
        with_offset = await reader.read(req, 0)
        by_time = await reader.read(req, None)
    finally:
        await reader.stop()
    assert with_offset.tokens == 3  # the log has them
    assert by_time.tokens == 3, f"the by-time prefix read found {by_time.tokens} of the 3 emitted tokens"
