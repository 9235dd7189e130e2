"""The tenancy view's catch-up rounds and refusals, over a fake consumer (no Kafka)."""

from __future__ import annotations

import asyncio
from datetime import timedelta

from aiokafka import TopicPartition
from aiokafka.errors import KafkaConnectionError

from runtime.settings import KafkaSettings
from runtime.tenancy import MISS_TTL_S, ApiKey, Refusal, TenancyView
from schemas.codec import codec_for
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


class CountingEnds:
    """end_offsets of a registry the view has read to its end; counts the round trips (``fail``: Kafka away)."""

    def __init__(self) -> None:
        self.asked = 0
        self.fail = False

    async def end_offsets(self, partitions: list[TopicPartition]) -> dict[TopicPartition, int]:
        self.asked += 1
        if self.fail:
            raise KafkaConnectionError()
        return {TP: 0}


def _current_view(consumer: CountingEnds, now: list[float], **misses: int) -> TenancyView:
    view = TenancyView(KafkaSettings(), catch_up_timeout_s=5, clock=lambda: now[0], **misses)  # type: ignore[arg-type]
    view._consumer = consumer  # type: ignore[assignment]
    view._partitions = [TP]
    view._applied = {TP: 0}
    created = utcnow()
    view.orgs["o"] = OrgRecord(org_id="o", name="o", tier="free", created_at=created, updated_at=created)
    return view


async def test_a_bad_key_presented_again_is_refused_without_another_round_trip_for_a_while() -> None:
    """Review finding L5: every request with an unknown key cost a Kafka round trip before its 401."""
    consumer, now = CountingEnds(), [0.0]
    view = _current_view(consumer, now)
    for _ in range(100):
        assert await view.authenticate("bad") is Refusal.UNKNOWN
    assert consumer.asked == 1
    now[0] += MISS_TTL_S
    assert await view.authenticate("bad") is Refusal.UNKNOWN
    assert consumer.asked == 2, "a miss is remembered for MISS_TTL_S, no longer"


async def test_a_new_key_and_a_missed_secret_registered_later_work_at_once() -> None:
    consumer, now = CountingEnds(), [0.0]
    view = _current_view(consumer, now)
    assert await view.authenticate("tried-then-registered") is Refusal.UNKNOWN
    for key_hash in ("tried-then-registered", "issued-elsewhere"):
        record = KeyRecord(key_hash=key_hash, key_id=f"k-{key_hash}", org_id="o", name="n", created_at=utcnow())
        view._apply(TopicPartition(view._key_topic, 0), key_hash.encode(), codec_for(KeyRecord).encode(record))
    assert isinstance(await view.authenticate("tried-then-registered"), ApiKey)
    assert isinstance(await view.authenticate("issued-elsewhere"), ApiKey)  # never missed: found on its first try


async def test_the_misses_are_bounded_and_a_miss_while_kafka_is_away_is_not_remembered() -> None:
    consumer, now = CountingEnds(), [0.0]
    view = _current_view(consumer, now, max_misses=2)
    for key_hash in ("a", "b", "c"):  # "a" is forgotten when "c" comes
        assert await view.authenticate(key_hash) is Refusal.UNKNOWN
    assert len(view._misses) == 2 and consumer.asked == 3
    assert await view.authenticate("c") is Refusal.UNKNOWN and consumer.asked == 3
    assert await view.authenticate("a") is Refusal.UNKNOWN and consumer.asked == 4
    consumer.fail = True
    assert await view.authenticate("d") is Refusal.UNKNOWN
    consumer.fail = False
    assert await view.authenticate("d") is Refusal.UNKNOWN and consumer.asked == 6, "a round that failed proves nothing"


def test_a_key_sees_its_own_orgs_streams_of_the_models_it_may_use_only() -> None:
    """Review finding L6: a key restricted to some models could resume, read and cancel its org's other streams."""
    created = utcnow()
    org = OrgRecord(org_id="o", name="o", tier="free", created_at=created, updated_at=created)

    def key(models: list[str]) -> ApiKey:
        return ApiKey(KeyRecord(key_hash="h", key_id="k", org_id="o", name="n", models=models, created_at=created), org)

    assert key(["small"]).may_see("o", "small")
    assert not key(["small"]).may_see("o", "large")
    assert not key(["small"]).may_see("other", "small")
    assert key([]).may_see("o", "large")  # no allow-list: every model
