"""Records a processor cannot decode go to the dead-letter topic with a reason; the processors go on."""

from __future__ import annotations

import uuid

import openai
import pytest

from runtime.kafka_clients import make_producer
from runtime.settings import Settings
from schemas.topics import TOPICS
from tests.e2e.conftest import MODEL, QUESTION, usage_events
from tests.helpers import read_topic, wait_for

pytestmark = pytest.mark.e2e
NOBODYS_PARTITION = 12  # no gateway tails it: only the topic tells what the worker did


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


async def test_a_request_of_an_unknown_schema_version_is_answered_at_once_not_left_to_time_out(
        worker: object, stack: Settings) -> None:
    """Defect 11: a record whose schema fingerprint a consumer did not know was skipped silently, so during a
    rolling deploy that adds a schema version requests vanished and clients waited out the timeout."""
    from schemas.codec import MAGIC, codec_for
    from schemas.events import TokenEvent
    from schemas.headers import request_headers

    kafka = stack.kafka
    request_id = f"chatcmpl-future-{uuid.uuid4().hex}"
    # A newer gateway's request: its schema's fingerprint is one this worker has never seen.
    future = MAGIC + bytes.fromhex("0123456789abcdef") + b"\x02body of a newer schema"
    producer = make_producer(kafka, role="test-future")
    await producer.start()
    try:
        await producer.send_and_wait(kafka.topic(TOPICS.requests_admitted.name), future, key=request_id.encode(),
                                     headers=request_headers(request_id, NOBODYS_PARTITION))
    finally:
        await producer.stop()

    async def answered() -> list[TokenEvent]:
        rows = await read_topic(kafka, kafka.topic(TOPICS.tokens.name), codec_for(TokenEvent))  # type: ignore[arg-type]
        return [e for tp, _, e, _ in rows if e.request_id == request_id and tp.partition == NOBODYS_PARTITION]

    (final,) = await wait_for(answered, timeout_s=20)
    assert (final.finish_reason, final.error_code) == ("error", "undecodable_request")

    async def dead_lettered() -> list:  # type: ignore[type-arg]
        rows = await read_topic(kafka, kafka.topic(TOPICS.dead_letter.name), Raw, isolation="read_committed")  # type: ignore[arg-type]
        return [dict(h) for _, _, value, h in rows if value == future]

    (headers,) = await wait_for(dead_lettered, timeout_s=20)
    assert headers["processor"] == b"worker" and b"unknown schema fingerprint" in headers["reason"]
