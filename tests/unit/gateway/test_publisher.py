"""The request record's timestamp is the wall clock to the *nearest* millisecond: the worker measures the Kafka hop
from it (``kns_kafka_hop_seconds{hop="gateway_to_worker"}``), and a truncated one read every hop 0.5 ms long on
average, an eighth of a 4 ms hop."""

from __future__ import annotations

from typing import Any

import pytest

from producers.gateway import publisher as publisher_module
from producers.gateway.publisher import EventPublisher
from runtime.settings import KafkaSettings
from schemas.topics import TOPICS
from tests.fakes.worker import request


class Producer:
    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    async def send_and_wait(self, topic: str, **kwargs: Any) -> None:
        self.sent.append({"topic": topic, **kwargs})


@pytest.mark.parametrize(("now_s", "stamped_ms"), [(1000.0009, 1_000_001), (1000.0004, 1_000_000)])
async def test_the_request_is_stamped_to_the_nearest_millisecond(monkeypatch: pytest.MonkeyPatch, now_s: float,
                                                                 stamped_ms: int) -> None:
    producer = Producer()
    events = EventPublisher(producer, KafkaSettings(), lambda _: TOPICS.work_queues()[0], TOPICS.control,  # type: ignore[arg-type]
                            "gateway-test")
    monkeypatch.setattr(publisher_module.time, "time", lambda: now_s)
    await events.submit(request(), "00-0-0-01")
    (sent,) = producer.sent
    assert sent["timestamp_ms"] == stamped_ms
