"""The gateway counts its 429s per key in memory and reports them in batches: a refusal does no I/O, and each report
is one event per key refused since the last one."""

from __future__ import annotations

import asyncio

import pytest
from aiokafka.errors import KafkaConnectionError

from producers.gateway.refusals import RefusalReport
from runtime.settings import KafkaSettings
from schemas.codec import codec_for
from schemas.events import RequestsRefused
from schemas.topics import TOPICS
from tests.fakes.tenancy import api_key

KAFKA = KafkaSettings(namespace="t")


class RecordingProducer:
    def __init__(self, fail: bool = False) -> None:
        self.sent: list[tuple[str, RequestsRefused, bytes]] = []
        self.fail = fail

    async def send(self, topic: str, value: bytes, key: bytes) -> asyncio.Future[None]:
        acked: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self.fail:
            acked.set_exception(KafkaConnectionError())
        else:
            self.sent.append((topic, codec_for(RequestsRefused).decode(value), key))
            acked.set_result(None)
        return acked


async def test_each_report_is_one_event_per_key_refused_since_the_last() -> None:
    now = [100.0]
    producer = RecordingProducer()
    report = RefusalReport(producer, KAFKA, "gw/1", clock=lambda: now[0])  # type: ignore[arg-type]
    hammer, other = api_key("hammer", org_id="acme", tier="free"), api_key("other", org_id="beta")
    for _ in range(240):
        report.note(hammer)
        now[0] += 0.001
    report.note(other)
    assert producer.sent == []  # counting does no I/O
    assert await report.report() == 2
    (topic, first, key), (_, second, _) = sorted(producer.sent, key=lambda s: s[1].key_id)
    assert topic == KAFKA.topic(TOPICS.requests_refused.name) and key == b"hammer"
    assert (first.key_id, first.org_id, first.tier, first.refused, first.gateway_id) == ("hammer", "acme", "free", 240,
                                                                                        "gw/1")
    assert first.first_at.timestamp() == pytest.approx(100.0) and first.last_at.timestamp() == pytest.approx(100.239)
    assert (second.key_id, second.refused) == ("other", 1)
    assert await report.report() == 0 and len(producer.sent) == 2  # nothing new: nothing sent


async def test_a_report_kafka_refuses_is_dropped_without_failing_the_gateway() -> None:
    report = RefusalReport(RecordingProducer(fail=True), KAFKA, "gw/1")  # type: ignore[arg-type]
    report.note(api_key())
    assert await report.report() == 0
    assert await report.report() == 0  # the failed interval's counts are not carried over


async def test_stopping_reports_what_was_counted_since_the_last_report() -> None:
    producer = RecordingProducer()
    report = RefusalReport(producer, KAFKA, "gw/1", every_s=3600)  # type: ignore[arg-type]
    report.start()
    report.note(api_key())
    await report.stop()
    assert [s[1].refused for s in producer.sent] == [1]
