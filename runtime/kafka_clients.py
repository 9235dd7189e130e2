"""The only place Kafka clients are built, and the one consumer loop.

``make_producer`` / ``make_consumer`` / ``make_admin`` turn settings into aiokafka clients with the platform's
defaults (idempotence and ``acks=all`` everywhere, ``read_committed`` unless a caller needs to see records
before their transaction commits). :func:`consume` owns polling, decoding, backpressure (pausing partitions
when the caller has no capacity), decode-error accounting and shutdown; callers supply an
``async def handle(event, record)``. It never commits: the callers that track offsets commit them themselves
(the worker inside its Kafka transaction).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Literal, Protocol, TypeVar

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError

from runtime.metrics import DECODE_ERRORS
from runtime.settings import KafkaSettings
from schemas.codec import EventCodec
from schemas.errors import DecodeError
from schemas.events import Event
from schemas.topics import TopicSpec

log = logging.getLogger(__name__)

E = TypeVar("E", bound=Event)
E_contra = TypeVar("E_contra", bound=Event, contravariant=True)

Isolation = Literal["read_committed", "read_uncommitted"]


def _compression(kafka: KafkaSettings) -> str | None:
    return None if kafka.compression == "none" else kafka.compression


def make_producer(
    kafka: KafkaSettings, *, role: str, transactional_id: str | None = None
) -> AIOKafkaProducer:
    """An idempotent producer (``acks=all``); transactional when ``transactional_id`` is given."""
    return AIOKafkaProducer(
        bootstrap_servers=kafka.bootstrap_servers,
        client_id=f"{kafka.client_id}-{role}",
        acks="all",
        enable_idempotence=True,
        transactional_id=kafka.group(transactional_id) if transactional_id else None,
        transaction_timeout_ms=kafka.transaction_timeout_ms,
        compression_type=_compression(kafka),
        linger_ms=kafka.producer_linger_ms,
        request_timeout_ms=kafka.request_timeout_ms,
    )


def make_consumer(
    kafka: KafkaSettings,
    *,
    role: str,
    group: str | None = None,
    instance_id: str | None = None,
    isolation: Isolation = "read_committed",
    auto_offset_reset: Literal["earliest", "latest"] = "earliest",
    max_partition_fetch_bytes: int = 1_048_576,
) -> AIOKafkaConsumer:
    """A consumer that never auto-commits. ``group=None`` gives a manually assigned consumer."""
    return AIOKafkaConsumer(
        bootstrap_servers=kafka.bootstrap_servers,
        client_id=f"{kafka.client_id}-{role}",
        group_id=kafka.group(group) if group else None,
        group_instance_id=instance_id if group else None,
        enable_auto_commit=False,
        isolation_level=isolation,
        auto_offset_reset=auto_offset_reset,
        fetch_max_wait_ms=kafka.fetch_max_wait_ms,
        max_partition_fetch_bytes=max_partition_fetch_bytes,
        session_timeout_ms=kafka.session_timeout_ms,
        heartbeat_interval_ms=kafka.heartbeat_interval_ms,
        max_poll_interval_ms=kafka.max_poll_interval_ms,
        request_timeout_ms=kafka.request_timeout_ms + 5_000,
    )


def make_admin(kafka: KafkaSettings) -> AIOKafkaAdminClient:
    return AIOKafkaAdminClient(
        bootstrap_servers=kafka.bootstrap_servers,
        client_id=f"{kafka.client_id}-admin",
        request_timeout_ms=kafka.request_timeout_ms,
    )


async def ensure_topics(kafka: KafkaSettings, specs: list[TopicSpec]) -> list[str]:
    """Create the topics that do not exist yet (idempotent); returns the names it created."""
    admin = make_admin(kafka)
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        missing = [
            NewTopic(
                name=kafka.topic(spec.name),
                num_partitions=spec.partitions,
                replication_factor=1,
                topic_configs=spec.configs(),
            )
            for spec in specs
            if kafka.topic(spec.name) not in existing
        ]
        if missing:
            # Created concurrently by another process: the end state is what we want.
            with contextlib.suppress(TopicAlreadyExistsError):
                await admin.create_topics(missing)
        return [t.name for t in missing]
    finally:
        await admin.close()


async def all_partitions(consumer: AIOKafkaConsumer, topic: str) -> list[TopicPartition]:
    """Every partition of ``topic``, from fresh metadata (a consumer without a subscription has none cached)."""
    cluster = await consumer._client.fetch_all_metadata()
    partitions = cluster.partitions_for_topic(topic)
    if not partitions:
        raise RuntimeError(f"topic {topic} does not exist (the stack manager creates it)")
    return [TopicPartition(topic, p) for p in sorted(partitions)]


class Handler(Protocol[E_contra]):
    async def __call__(self, event: E_contra, record: ConsumerRecord[bytes, bytes], /) -> None: ...


async def consume(
    consumer: AIOKafkaConsumer,
    codec: EventCodec[E],
    handle: Handler[E],
    *,
    stop: asyncio.Event,
    capacity: Callable[[], int] | None = None,
    room_freed: asyncio.Event | None = None,
    on_batch_end: Callable[[], Awaitable[None]] | None = None,
    poll_timeout_ms: int = 100,
) -> None:
    """Poll ``consumer`` until ``stop`` is set; decode each record and await ``handle(event, record)``.

    ``capacity()`` (optional) says how many more records the caller can take now; at 0 every assigned
    partition is paused and the loop sleeps until ``room_freed`` is set (or a second passes: polling goes on
    so that the group membership stays alive). Records that do not decode are counted and skipped: one bad
    record never stops a service.
    """
    paused = False
    while not stop.is_set():
        # 1. Backpressure: fetch only what the caller can take.
        room = capacity() if capacity is not None else None
        if room is not None and room <= 0:
            if not paused:
                consumer.pause(*consumer.assignment())
                paused = True
            if room_freed is not None:
                room_freed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(room_freed.wait(), 1.0)
            else:
                await asyncio.sleep(0.01)
            # Keep the poll loop alive (max.poll.interval) while paused; nothing is returned.
            await consumer.getmany(timeout_ms=0)
            continue
        if paused:
            consumer.resume(*consumer.assignment())
            paused = False
        # 2. Fetch.
        batches = await consumer.getmany(timeout_ms=poll_timeout_ms, max_records=room)
        # 3. Decode and hand over, in partition order.
        for tp, records in batches.items():
            for record in records:
                if record.value is None:
                    continue
                try:
                    event = codec.decode(record.value)
                except DecodeError as exc:
                    DECODE_ERRORS.labels(topic=tp.topic).inc()
                    log.warning(
                        "undecodable record skipped",
                        extra={"topic": tp.topic, "partition": tp.partition, "offset": record.offset,
                               "reason": str(exc)},
                    )
                    continue
                await handle(event, record)
        if on_batch_end is not None:
            await on_batch_end()
