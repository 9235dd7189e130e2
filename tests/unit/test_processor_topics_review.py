"""Review of ae28b6c (internal topics created before the Faust worker starts): pure logic, no services.

Fakes stand in for the admin client only; the apps are real ``ProcessorApp``s that never start.
"""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest

from runtime import kafka_clients
from runtime.settings import KafkaSettings
from stream_processors.app import ProcessorApp
from tests.faust_reference import as_faust_creates


def _app() -> ProcessorApp:
    return ProcessorApp("ns.kns-review", broker="kafka://localhost:1", store="memory://", topic_partitions=6,
                        topic_replication_factor=1)


class _Admin:
    """aiokafka's admin client as it behaves: ``create_topics`` returns the broker's per-topic errors, it does not
    raise them (aiokafka/admin/client.py ``create_topics`` -> ``_send_to_controller``)."""

    def __init__(self, errors: dict[str, int]) -> None:
        self.errors = errors

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def list_topics(self) -> list[str]:
        return []

    async def create_topics(self, topics: list[Any], timeout_ms: int | None = None) -> Any:
        return SimpleNamespace(topic_errors=[(t.name, self.errors.get(t.name, 0), None) for t in topics])


@pytest.mark.parametrize("code", [7, 41, 40])  # REQUEST_TIMED_OUT, NOT_CONTROLLER, INVALID_CONFIG
async def test_a_topic_the_broker_did_not_create_is_an_error_not_reported_as_created(
        monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    app = _app()
    app.Table("counts", default=int).tumbling(10.0, expires=timedelta(seconds=40)).relative_to_stream()
    topics = app.internal_topics()
    monkeypatch.setattr(kafka_clients, "make_admin", lambda kafka: _Admin({topics[0].name: code}))
    # Today: returns [name] ("internal topics created") and the Faust worker starts without it: the original race.
    with pytest.raises(Exception):  # noqa: B017 - any error: the runner must not go on to start the worker
        await kafka_clients.create_missing_topics(KafkaSettings(), topics)


def test_the_assignor_leader_topic_exists_before_the_worker_starts() -> None:
    """Faust subscribes ``<id>-__assignor-__leader`` (LeaderAssignor.on_start declares it during the start): a first
    assignment computed before it is in the metadata has no leader until the next rebalance."""
    app = _app()
    names = {t.name for t in app.internal_topics()}
    assert f"{app.conf.id}-__assignor-__leader" in names


def test_extra_topic_configs_take_precedence_as_in_faust() -> None:
    """Faust builds ``_topic_config(retention, compacting, deleting)`` and then ``config.update(topic.config)``
    (aiokafka driver ``_really_create_topic``): the table's own configs win, in ours as in Faust's (the review
    found them reversed)."""
    app = _app()
    app.Table("counts", default=int, extra_topic_configs={"cleanup.policy": "compact", "retention.ms": "1000"}
              ).tumbling(10.0, expires=timedelta(seconds=40)).relative_to_stream()
    (table,) = app.tables.values()
    topic = table.changelog_topic
    ours = next(t for t in app.internal_topics() if t.name == topic.get_topic_name())
    assert ours.topic_configs == as_faust_creates(topic)
