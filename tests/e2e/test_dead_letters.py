"""Records a processor cannot decode go to the dead-letter topic with a reason; the processors go on."""

from __future__ import annotations

import openai
import pytest

from runtime.kafka_clients import make_producer
from runtime.settings import Settings
from schemas.topics import TOPICS
from tests.e2e.conftest import MODEL, QUESTION, usage_events
from tests.helpers import read_topic, wait_for

pytestmark = pytest.mark.e2e


class Raw:
    @staticmethod
    def decode(value: bytes) -> bytes:
        return value


async def test_garbage_is_dead_lettered_and_processing_continues(client: openai.OpenAI, stack: Settings) -> None:
    kafka = stack.kafka
    producer = make_producer(kafka, role="test-garbage")
    await producer.start()
    try:
        for spec in (TOPICS.usage, TOPICS.requests_submitted):
            await producer.send_and_wait(kafka.topic(spec.name), b"\x00not avro at all", key=b"garbage")
    finally:
        await producer.stop()

    async def dead_letters() -> list:  # type: ignore[type-arg]
        rows = await read_topic(kafka, kafka.topic(TOPICS.dead_letter.name), Raw, isolation="read_committed")  # type: ignore[arg-type]
        return [dict(h) for _, _, value, h in rows if value == b"\x00not avro at all"]

    found = await wait_for(lambda: _both(dead_letters), timeout_s=30)
    assert found, "the garbage was not dead-lettered"
    sources = {h["source-topic"].decode(): h for h in found}
    assert set(sources) >= {kafka.topic(TOPICS.usage.name), kafka.topic(TOPICS.requests_submitted.name)}
    assert all(b"Avro" in h["reason"] or b"avro" in h["reason"] for h in found)
    # ... and the processors still work: a real request is admitted, generated and billed.
    answer = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=3)
    assert await wait_for(lambda: usage_events(stack, answer.id))


async def _both(read) -> list | None:  # type: ignore[no-untyped-def, type-arg]
    found = await read()
    return found if len({h["source-topic"] for h in found}) >= 2 else None
