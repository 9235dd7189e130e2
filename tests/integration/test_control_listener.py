"""On the real broker: the worker's control listener misses no event written while it starts.

It follows with long polls (``follower=True``), so it looks its start offsets up before it fetches; an adversarial
review found that the old order (offsets for times, then ``seek_to_end`` for a partition with nothing in the
look-back) skipped a cancel written between the two: a worker that then took the request over generated it to
the end and billed it in full."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from aiokafka.admin import NewTopic
from aiokafka.errors import KafkaTimeoutError

import inference_workers.control as control
from inference_workers.control import ControlListener
from runtime.kafka_clients import make_producer
from runtime.settings import KafkaSettings, Settings
from schemas.codec import codec_for
from schemas.events import ControlAction, ControlEvent, utcnow
from schemas.topics import TOPICS
from tests.helpers import scratch_topics

pytestmark = pytest.mark.integration


@pytest_asyncio.fixture(loop_scope="session")
async def control_topic(settings: Settings) -> AsyncIterator[tuple[KafkaSettings, str]]:
    kafka = settings.kafka
    name = kafka.topic(f"test-control-{uuid.uuid4().hex[:8]}")
    async with scratch_topics(kafka, NewTopic(name, 3, 1, topic_configs=TOPICS.control.configs())):  # empty
        yield kafka, name


async def test_a_cancel_written_while_the_listener_looks_up_where_to_start_is_delivered(
        control_topic: tuple[KafkaSettings, str], monkeypatch: pytest.MonkeyPatch) -> None:
    kafka, topic = control_topic
    producer = make_producer(kafka, role="test-control-issuer")
    await producer.start()
    codec = codec_for(ControlEvent)
    written: list[str] = []

    async def cancel_now() -> None:
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        event = ControlEvent(request_id=request_id, action=ControlAction.CANCEL, reason="test",
                             issued_by="test", issued_at=utcnow())
        await producer.send_and_wait(topic, codec.encode(event), key=request_id.encode(), partition=1)
        written.append(request_id)

    real_make_consumer = control.make_consumer

    def consumer_that_races(*args: Any, **kwargs: Any) -> Any:
        consumer = real_make_consumer(*args, **kwargs)
        for lookup in ("end_offsets", "offsets_for_times"):
            real = getattr(consumer, lookup)

            async def then_cancel(*a: Any, _real: Any = real, **kw: Any) -> Any:
                answer = await _real(*a, **kw)
                await cancel_now()  # lands right after this lookup answered
                return answer

            setattr(consumer, lookup, then_cancel)
        return consumer

    monkeypatch.setattr(control, "make_consumer", consumer_that_races)
    received: list[str] = []
    listener = ControlListener(kafka, topic, lookback_s=60.0, on_event=lambda e: received.append(e.request_id))
    try:
        await listener.start()
        for _ in range(100):
            if set(written) <= set(received):
                break
            await asyncio.sleep(0.1)
        assert set(written) <= set(received), f"written {written}, delivered {received}"
        assert len(written) == 2  # one after each lookup
    finally:
        await listener.stop()
        await producer.stop()


async def test_a_start_that_cannot_look_up_its_offsets_leaves_no_consumer_open(
        control_topic: tuple[KafkaSettings, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A second review: a lookup that fails (Kafka away longer than a request's timeout) raised out of start()
    with the consumer running, before the worker could stop it."""
    kafka, topic = control_topic
    started: list[Any] = []
    real_make_consumer = control.make_consumer

    def consumer_without_offsets(*args: Any, **kwargs: Any) -> Any:
        consumer = real_make_consumer(*args, **kwargs)

        async def unreachable(*_a: Any, **_kw: Any) -> Any:
            raise KafkaTimeoutError()

        consumer.end_offsets = unreachable
        started.append(consumer)
        return consumer

    monkeypatch.setattr(control, "make_consumer", consumer_without_offsets)
    listener = ControlListener(kafka, topic, lookback_s=60.0, on_event=lambda _e: None)
    with pytest.raises(KafkaTimeoutError):
        await listener.start()
    assert started and started[0]._closed, "the consumer was left running"
