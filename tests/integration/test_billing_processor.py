"""The billing processor (a real Faust process, no engine): it records which price version billed a request, and a
usage event its price book cannot vouch for even after a reload is dead-lettered, never priced with the book it has."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime, timedelta

import pytest

from billing.ledger import Ledger
from billing.prices import load_seed
from runtime.cassandra_client import connect_async
from runtime.kafka_clients import make_producer
from runtime.settings import Settings
from schemas.codec import codec_for
from schemas.events import UsageEvent
from schemas.topics import TOPICS
from tests.helpers import ServiceProcess, read_topic, wait_for

pytestmark = pytest.mark.integration


class Raw:
    @staticmethod
    def decode(value: bytes) -> bytes:
        return value


@pytest.mark.timeout(180)  # up to 30 s for the dead letter and 60 s for the bill
async def test_billing_records_the_version_and_refuses_what_its_book_cannot_vouch_for(
        stack: Settings, processors: dict[str, ServiceProcess]) -> None:
    (seed,) = load_seed()
    now = datetime.now(UTC)

    def usage(at: datetime) -> UsageEvent:
        return UsageEvent(request_id=f"req-{uuid.uuid4().hex}", org_id=f"org-{uuid.uuid4().hex[:8]}", key_id="k",
                          tier="pro", model=seed.model, prompt_tokens=10, completion_tokens=4, cached_tokens=0,
                          finish_reason="stop", attempt=1, worker_id="w", requested_at=at, started_at=at,
                          finished_at=at)

    # An hour ahead is past any book's reach (2 reload intervals): a version added since might apply then.
    billable, too_far = usage(now - timedelta(seconds=1)), usage(now + timedelta(hours=1))
    producer = make_producer(stack.kafka, role="test-billing")
    await producer.start()
    try:
        for event in (too_far, billable):
            await producer.send_and_wait(stack.kafka.topic(TOPICS.usage.name), codec_for(UsageEvent).encode(event),
                                         key=event.request_id.encode())
    finally:
        await producer.stop()
    cluster, session = await connect_async(stack.cassandra)
    try:
        ledger = await Ledger.open(session, stack.cassandra.keyspace)

        async def dead_letter_reason() -> bytes | None:
            rows = await read_topic(stack.kafka, stack.kafka.topic(TOPICS.dead_letter.name), Raw)  # type: ignore[arg-type]
            wanted = too_far.request_id.encode()
            return next((dict(h)["reason"] for _, _, value, h in rows if wanted in value), None)  # type: ignore[operator]

        reason = await wait_for(dead_letter_reason, timeout_s=30)
        assert reason is not None and b"cannot price" in reason, "the far-future usage was not dead-lettered"
        assert await ledger.get(too_far.request_id) is None  # not billed with a book that cannot vouch for it
        assert await wait_for(lambda: ledger.get(billable.request_id), timeout_s=60), "the usage was not billed"
        row = await ledger.get(billable.request_id)
        assert row is not None and (row.price_version, row.price_valid_from) == (seed.version, seed.valid_from)
    finally:
        await asyncio.to_thread(cluster.shutdown)
