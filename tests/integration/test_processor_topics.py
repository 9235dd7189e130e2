"""A processor's internal topics (table changelogs, repartition topics) exist before its Faust worker starts.

When Faust created them itself, while its worker was starting, its first partition assignment could be computed
from metadata that lacked one; a changelog missing from the assignment fails every write to its table, and a
restarted worker with the same static membership is handed that assignment back and crash-loops (seen in a
fresh-clone CI run: the abuse processor's restarts failed with ``KeyError('...-abuse-velocity-changelog')``).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

from runtime.kafka_clients import create_missing_topics, make_admin
from runtime.settings import Settings
from stream_processors.abuse.processor import build
from stream_processors.app import ProcessorApp
from tests.faust_reference import as_faust_creates
from tests.helpers import ServiceProcess

pytestmark = pytest.mark.integration


def log_records(service: ServiceProcess) -> list[dict[str, Any]]:
    records = []
    for line in service.log_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


async def described(settings: Settings, names: list[str]) -> tuple[dict[str, int], dict[str, dict[str, str]]]:
    """Partition counts and the cleanup/retention configs of the named topics, as the broker has them."""
    admin = make_admin(settings.kafka)
    await admin.start()
    try:
        partitions = {t["topic"]: len(t["partitions"]) for t in await admin.describe_topics(names)}
        responses = await admin.describe_configs(
            [ConfigResource(ConfigResourceType.TOPIC, name, {"cleanup.policy": None, "retention.ms": None})
             for name in names])
        configs: dict[str, dict[str, str]] = {}
        for response in responses:
            for _code, _message, _type, name, entries in response.resources:
                configs[name] = {entry[0]: entry[1] for entry in entries}
        return partitions, configs
    finally:
        await admin.close()


@pytest.fixture(scope="module")
def abuse_app(stack: Settings) -> ProcessorApp:
    return build(stack)


def test_the_abuse_processor_created_its_internal_topics_before_its_faust_worker_started(
        processors: dict[str, ServiceProcess], abuse_app: ProcessorApp) -> None:
    records = log_records(processors["abuse"])  # this session's namespace: the first start found none of them
    created = next(i for i, r in enumerate(records) if r.get("msg") == "internal topics created")
    worker_start = next(i for i, r in enumerate(records) if r.get("msg", "").startswith("[^Worker]: Starting"))
    assert created < worker_start
    expected = {t.name for t in abuse_app.internal_topics()}
    assert len(expected) == 4 + 4 + 1  # four windowed tables, four streams re-keyed by API key, the leader topic
    assert set(records[created]["topics"]) == expected


async def test_internal_topics_have_the_partitions_and_configs_faust_would_give_them(
        stack: Settings, processors: dict[str, ServiceProcess], abuse_app: ProcessorApp) -> None:
    # The processor made them; creating them again creates nothing.
    assert await create_missing_topics(stack.kafka, abuse_app.internal_topics()) == []
    topics = {t.get_topic_name(): t for t in [table.changelog_topic for table in abuse_app.tables.values()]}
    repartitions = [t.name for t in abuse_app.internal_topics() if t.name.endswith("-repartition")]
    partitions, configs = await described(stack, [*topics, *repartitions])
    assert set(partitions) == {*topics, *repartitions}
    assert set(partitions.values()) == {abuse_app.conf.topic_partitions}
    for name, topic in topics.items():
        assert configs[name] == as_faust_creates(topic)
        assert configs[name]["cleanup.policy"] == "compact,delete"  # windowed: old windows are deleted
    assert all(configs[name]["cleanup.policy"] == "delete" for name in repartitions)
