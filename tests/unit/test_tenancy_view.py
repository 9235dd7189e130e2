"""The tenancy view's catch-up rounds and refusals, over a fake consumer (no Kafka)."""

from __future__ import annotations

import asyncio
from datetime import timedelta

from aiokafka import TopicPartition

from runtime.settings import KafkaSettings
from runtime.tenancy import ApiKey, Refusal, TenancyView
from schemas.events import KeyRecord, OrgRecord, utcnow
from tests.helpers import wait_for

TP = TopicPartition("keys", 0)


class SlowEnds:
    """end_offsets answers what the topic holds when asked, after ``release`` is set."""

    def __init__(self) -> None:
        self.end = 1
        self.release = asyncio.Event()
        self.asked = 0
        self.first_asked = asyncio.Event()

    async def end_offsets(self, partitions: list[TopicPartition]) -> dict[TopicPartition, int]:
        self.asked += 1
        self.first_asked.set()
        end = self.end
        await self.release.wait()
        return {TP: end}


def _view(consumer: SlowEnds) -> TenancyView:
    view = TenancyView(KafkaSettings(), catch_up_timeout_s=5)
    view._consumer = consumer  # type: ignore[assignment]
    view._partitions = [TP]
    view._applied = {TP: 0}
    return view


async def _apply_up_to(view: TenancyView, offset: int) -> None:
    view._applied[TP] = offset
    async with view._advanced:
        view._advanced.notify_all()


async def test_a_miss_during_a_round_waits_for_the_next_round() -> None:
    """Review finding: a caller joining a round already under way got end offsets read before its key was
    written, so a key issued a moment ago on another gateway could get 401 (again and again under a flood)."""
    consumer = SlowEnds()
    view = _view(consumer)
    first = asyncio.create_task(view.catch_up())
    await consumer.first_asked.wait()
    consumer.end = 2  # another gateway's key record lands at offset 1
    second = asyncio.create_task(view.catch_up())
    third = asyncio.create_task(view.catch_up())
    consumer.release.set()
    await _apply_up_to(view, 1)
    assert await first is True
    await wait_for(lambda: consumer.asked == 2, timeout_s=5, interval_s=0, what="the second round's lookup")
    assert not second.done(), "the second caller was answered from a round older than its key"
    await _apply_up_to(view, 2)
    assert await second is True and await third is True
    assert consumer.asked == 2, "callers waiting at the same moment share one round"


def test_a_revoked_or_expired_key_is_refused_and_a_future_revocation_is_a_grace() -> None:
    view = TenancyView(KafkaSettings())
    now = utcnow()
    view.orgs["o"] = OrgRecord(org_id="o", name="o", tier="free", created_at=now, updated_at=now)

    def key(name: str, **fields: object) -> str:
        view.keys[name] = KeyRecord(key_hash=name, key_id="k", org_id="o", name=name, created_at=now,
                                    **fields)  # type: ignore[arg-type]
        return name

    assert view._resolve(key("revoked", revoked_at=now - timedelta(seconds=1))) is Refusal.REVOKED
    assert view._resolve(key("expired", expires_at=now - timedelta(seconds=1))) is Refusal.EXPIRED
    assert isinstance(view._resolve(key("grace", revoked_at=now + timedelta(minutes=5))), ApiKey)
    assert view._resolve("nobody") is Refusal.UNKNOWN
    view.keys["orphan"] = KeyRecord(key_hash="orphan", key_id="k2", org_id="gone", name="x", created_at=now)
    assert view._resolve("orphan") is Refusal.UNKNOWN
