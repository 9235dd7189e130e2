"""The one Faust App factory and the helpers every processor shares.

Each processor (safety, billing, abuse) is its own process with its own consumer group, web port (``/metrics``,
``/health``) and static group membership, so a restarted processor takes its partitions back at once instead of
waiting for its dead predecessor's session to time out. Source topics are created by the stack manager. A
processor's internal topics (table changelogs, ``group_by`` repartition topics) are declared here and created by
the runner before its Faust worker starts: Faust would create them itself, but while it does, its first partition
assignment can be computed from metadata without them. A changelog missing from that assignment makes every
table write fail (``KeyError`` in ``group_for_topic``), and with static membership a restarted worker is handed the
same assignment back, so it crash-loops.
"""

from __future__ import annotations

import logging
import socket
from typing import Any, Literal, TypeVar

import faust
from aiokafka.admin import NewTopic
from faust.types import EventT
from mode.utils.times import want_seconds
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from runtime.metrics import DEAD_LETTERED, DECODE_ERRORS
from runtime.settings import Settings
from schemas.codec import EventCodec
from schemas.errors import DecodeError
from schemas.events import Event
from schemas.topics import TOPICS, TopicSpec

log = logging.getLogger(__name__)

Guarantee = Literal["exactly_once", "at_least_once"]
E = TypeVar("E", bound=Event)


class ProcessorApp(faust.App):
    """A Faust app that knows every topic it keeps state in, so they can exist before it starts."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._repartition_topics: list[faust.TopicT] = []

    def repartition_topic(self, name: str) -> faust.TopicT:
        """The topic a ``group_by(..., topic=...)`` re-keys through (raw bytes, the app's partition count)."""
        topic = self.topic(f"{self.conf.id}-{name}-repartition", key_serializer="raw", value_serializer="raw",
                           partitions=self.conf.topic_partitions, internal=True)
        self._repartition_topics.append(topic)
        return topic

    def internal_topics(self) -> list[NewTopic]:
        """Table changelogs, repartition topics and the leader topic, configured as Faust itself would create
        them (``Topic.declare``: the topic's partitions and replicas, else the app's)."""
        conf = self.conf
        topics = [table.changelog_topic for table in self.tables.values()] + self._repartition_topics
        declared = [NewTopic(name=topic.get_topic_name(), num_partitions=topic.partitions or conf.topic_partitions,
                             replication_factor=topic.replicas or conf.topic_replication_factor,
                             topic_configs=_configs(topic))
                    for topic in topics]
        if not conf.topic_disable_leader:  # faust's LeaderAssignor subscribes to it while the worker starts
            declared.append(NewTopic(name=f"{conf.id}-__assignor-__leader", num_partitions=1,
                                     replication_factor=conf.topic_replication_factor))
        return declared


def _configs(topic: faust.TopicT) -> dict[str, str]:
    """Faust's order (its aiokafka driver's ``_really_create_topic``): cleanup policy and retention from the topic's
    flags, then the topic's own configs over them."""
    policy = [flag for flag, on in (("compact", topic.compacting), ("delete", topic.deleting)) if on]
    configs: dict[str, str] = {}
    if policy:
        configs["cleanup.policy"] = ",".join(policy)
    if topic.retention:
        configs["retention.ms"] = str(int(want_seconds(topic.retention) * 1000))
    configs.update((key, str(value)) for key, value in (topic.config or {}).items())
    return configs


def build_app(settings: Settings, name: str, *, guarantee: Guarantee) -> ProcessorApp:
    kafka, procs = settings.kafka, settings.processors
    datadir = settings.stack.root / "data" / "faust" / kafka.group(name)
    datadir.mkdir(parents=True, exist_ok=True)
    app = ProcessorApp(
        kafka.group(f"kns-{name}"),
        broker=[f"kafka://{server}" for server in kafka.bootstrap_servers.split(",")],
        store="memory://",
        processing_guarantee=guarantee,
        topic_replication_factor=1,
        topic_partitions=6,
        broker_session_timeout=procs.session_timeout_s,
        broker_heartbeat_interval=procs.heartbeat_interval_s,
        broker_commit_interval=procs.commit_interval_s,
        consumer_group_instance_id=f"{name}-{socket.gethostname()}-{procs.port(name)}",
        # A new group reads from the beginning: nothing produced before a processor first started is missed.
        consumer_auto_offset_reset="earliest",
        web_enabled=True,
        web_host=procs.host,
        web_port=procs.port(name),
        datadir=str(datadir),
        stream_wait_empty=False,
        producer_linger=0.0,
    )

    @app.page("/metrics")
    async def metrics(web: Any, request: Any) -> Any:
        # aiohttp refuses a charset in content_type; the exposition format's type carries one, so: a header.
        return web.bytes(generate_latest(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    @app.page("/health")
    async def health(web: Any, request: Any) -> Any:
        ready = app.rebalancing is False and app.consumer is not None
        return web.json({"status": "ok" if ready else "starting", "processor": name},
                        status=200 if ready else 503)

    return app


def raw_topic(app: faust.App, settings: Settings, spec: TopicSpec) -> faust.TopicT:
    """A source or sink topic of ours: bytes in, bytes out; our codec does the Avro."""
    return app.topic(settings.kafka.topic(spec.name), key_serializer="raw", value_serializer="raw")


class DeadLetters:
    """Records a processor cannot decode go to the dead-letter topic, as they came, with the reason in a header;
    they are counted and skipped, and never stop the processor."""

    def __init__(self, app: faust.App, settings: Settings, processor: str) -> None:
        self._topic = raw_topic(app, settings, TOPICS.dead_letter)
        self._processor = processor

    async def decode(self, codec: EventCodec[E], event: EventT) -> E | None:
        try:
            return codec.decode(event.value)
        except DecodeError as exc:
            await self.send(event, str(exc))
            return None

    async def send(self, event: EventT, reason: str) -> None:
        message = event.message
        DECODE_ERRORS.labels(topic=message.topic).inc()
        DEAD_LETTERED.labels(processor=self._processor, topic=message.topic).inc()
        log.warning("record dead-lettered", extra={"topic": message.topic, "partition": message.partition,
                                                   "offset": message.offset, "reason": reason})
        await self._topic.send(key=event.key, value=event.value, headers=[
            ("reason", reason.encode()),
            ("source-topic", message.topic.encode()),
            ("source-partition", str(message.partition).encode()),
            ("source-offset", str(message.offset).encode()),
            ("processor", self._processor.encode()),
        ])
