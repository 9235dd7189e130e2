"""The only place Kafka clients are built, and the one consumer loop.

``make_producer`` / ``make_consumer`` / ``make_admin`` turn settings into aiokafka clients with the platform's
defaults (idempotence and ``acks=all`` everywhere, ``read_committed`` unless a caller needs to see records
before their transaction commits). :func:`consume` owns polling, decoding, backpressure (pausing partitions
when the caller has no capacity), deferral (a handler that cannot proceed now), undecodable records and
shutdown; callers supply an ``async def handle(event, record)``. It never commits: the callers that track
offsets commit them themselves (the worker inside its Kafka transactions). Two aiokafka behaviours while no
broker answers are mended here, for every client built here (faust's processors build their own): failed metadata
updates back off (``_metadata_backoff``) and consumers stop whole (:func:`stop_consumer`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Literal, Protocol, TypeVar

from aiokafka import AIOKafkaClient, AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError, for_code
from aiokafka.structs import OffsetAndMetadata

from runtime.metrics import DECODE_ERRORS
from runtime.settings import KafkaSettings
from schemas.codec import EventCodec
from schemas.errors import DecodeError, RetryLater
from schemas.events import Event
from schemas.topics import TopicSpec

log = logging.getLogger(__name__)

E = TypeVar("E", bound=Event)
E_contra = TypeVar("E_contra", bound=Event, contravariant=True)

Isolation = Literal["read_committed", "read_uncommitted"]


#: fetches of the cluster's metadata before a topic is declared missing (about 5 s in all)
METADATA_ATTEMPTS = 10
#: the longest pause between two failed metadata updates of one client (they start at its retry_backoff_ms)
METADATA_BACKOFF_MAX_S = 1.0


def _metadata_backoff(client: AIOKafkaClient) -> None:
    """Pause a client's metadata updates after each failed one, doubling up to ``METADATA_BACKOFF_MAX_S``.

    aiokafka (0.14) retries them with no pause while no broker answers: a failed connect asks for a metadata update,
    and its producer's sender and consumer's fetcher wait on that update and ask again at once. A refused connect
    takes microseconds, so every client spun (thousands of failed connects per second per worker, 400k log lines
    per outage, the CPU the broker needed to come back). Kafka's own clients back off (reconnect.backoff.max.ms).
    The pause is inside the update, so everything waiting on it waits too."""
    update = client._metadata_update  # aiokafka has no setting for it
    delay: float = client._retry_backoff

    async def update_or_back_off(cluster: object, topics: object) -> bool:
        nonlocal delay
        updated: bool = await update(cluster, topics)
        if updated:
            delay = client._retry_backoff
        else:
            await asyncio.sleep(delay)
            delay = min(delay * 2, METADATA_BACKOFF_MAX_S)
        return updated

    client._metadata_update = update_or_back_off


def _compression(kafka: KafkaSettings) -> str | None:
    return None if kafka.compression == "none" else kafka.compression


def make_producer(
    kafka: KafkaSettings, *, role: str, transactional_id: str | None = None
) -> AIOKafkaProducer:
    """An idempotent producer (``acks=all``); transactional when ``transactional_id`` is given."""
    producer = AIOKafkaProducer(
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
    _metadata_backoff(producer.client)
    return producer


def make_consumer(
    kafka: KafkaSettings,
    *,
    role: str,
    group: str | None = None,
    instance_id: str | None = None,
    isolation: Isolation = "read_committed",
    auto_offset_reset: Literal["earliest", "latest"] = "earliest",
    max_partition_fetch_bytes: int = 1_048_576,
    assignors: Sequence[object] = (),
    follower: bool = False,
) -> AIOKafkaConsumer:
    """A consumer that never auto-commits. ``group=None`` gives a manually assigned consumer; ``assignors``
    replaces the group's partition assignment strategy (aiokafka's round robin). ``follower``: once it follows it never
    pauses, resumes or seeks a partition nor looks offsets up (its idle polls can be long:
    ``kafka.follow_fetch_max_wait_ms``; anything else waits out the poll parked at the broker)."""
    extra: dict[str, object] = {"partition_assignment_strategy": tuple(assignors)} if assignors else {}
    consumer = AIOKafkaConsumer(
        bootstrap_servers=kafka.bootstrap_servers,
        client_id=f"{kafka.client_id}-{role}",
        group_id=kafka.group(group) if group else None,
        group_instance_id=instance_id if group else None,
        enable_auto_commit=False,
        isolation_level=isolation,
        auto_offset_reset=auto_offset_reset,
        fetch_max_wait_ms=kafka.follow_fetch_max_wait_ms if follower else kafka.fetch_max_wait_ms,
        max_partition_fetch_bytes=max_partition_fetch_bytes,
        session_timeout_ms=kafka.session_timeout_ms,
        heartbeat_interval_ms=kafka.heartbeat_interval_ms,
        max_poll_interval_ms=kafka.max_poll_interval_ms,
        request_timeout_ms=kafka.request_timeout_ms + 5_000,
        **extra,
    )
    _metadata_backoff(consumer._client)
    return consumer


def make_admin(kafka: KafkaSettings) -> AIOKafkaAdminClient:
    admin = AIOKafkaAdminClient(
        bootstrap_servers=kafka.bootstrap_servers,
        client_id=f"{kafka.client_id}-admin",
        request_timeout_ms=kafka.request_timeout_ms,
    )
    _metadata_backoff(admin._client)
    return admin


async def stop_consumer(consumer: AIOKafkaConsumer) -> None:
    """``consumer.stop()``, done whole. aiokafka (0.14) cancels the consumer's fetches and awaits them, and a fetch
    waiting out its retry back-off (its broker away) raises that CancelledError out of ``stop()`` before the client
    is closed: a worker stopping on a fatal error exited with an unexplained CancelledError, and the consumer's
    connections and metadata task lived on (spinning while the broker was away). Whatever ``stop()`` raises, what
    it left open is closed; only this task's own cancellation, or another error, is raised again."""
    try:
        await consumer.stop()
    except BaseException as exc:
        await _close_what_stop_left(consumer)
        task = asyncio.current_task()
        if not isinstance(exc, asyncio.CancelledError) or (task is not None and task.cancelling()):
            raise


async def _close_what_stop_left(consumer: AIOKafkaConsumer) -> None:
    fetcher = consumer._fetcher
    tasks = [fetcher._fetch_task, *fetcher._pending_tasks] if fetcher is not None else []
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await consumer._client.close()


async def ensure_topics(kafka: KafkaSettings, specs: list[TopicSpec]) -> list[str]:
    """Create the topics that do not exist yet (idempotent); returns the names it created."""
    return await create_missing_topics(kafka, [
        NewTopic(name=kafka.topic(spec.name), num_partitions=spec.partitions, replication_factor=1,
                 topic_configs=spec.configs())
        for spec in specs
    ])


async def create_missing_topics(kafka: KafkaSettings, topics: list[NewTopic]) -> list[str]:
    """Create those of ``topics`` (full names) that do not exist yet; returns the names it created."""
    admin = make_admin(kafka)
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        missing = [topic for topic in topics if topic.name not in existing]
        if not missing:
            return []
        # The broker answers per topic, and aiokafka returns those answers instead of raising them.
        response = await admin.create_topics(missing)
        created = []
        for name, code, *_ in response.topic_errors:
            if code == 0:
                created.append(name)
            elif code != TopicAlreadyExistsError.errno:  # created concurrently by another process: as wanted
                raise for_code(code)(f"topic {name!r} not created")
        return created
    finally:
        await admin.close()


async def committed_with_metadata(consumer: AIOKafkaConsumer, partitions: Iterable[TopicPartition]
                                  ) -> dict[TopicPartition, OffsetAndMetadata | None]:
    """The group's committed offsets *with their metadata* (aiokafka's public ``committed()`` drops it); None
    where nothing was committed yet."""
    wanted = list(partitions)
    found = await consumer._coordinator.fetch_committed_offsets(wanted)  # aiokafka has no public API for it
    return {tp: (om if om is not None and om.offset >= 0 else None) for tp, om in
            ((tp, found.get(tp)) for tp in wanted)}


async def read_to_end(kafka: KafkaSettings, topic: str, codec: EventCodec[E], *,
                      isolation: Isolation = "read_committed"
                      ) -> list[tuple[TopicPartition, int, E, list[tuple[str, bytes]]]]:
    """Everything a topic holds now (up to its end offsets), decoded, as (partition, offset, event, headers);
    undecodable records are left out. Under read_committed an open transaction holds the reader back, so it
    also stops after a few empty polls. For operators' tools, audits and tests, not for services."""
    consumer = make_consumer(kafka, role="reader", isolation=isolation)
    await consumer.start()
    try:
        partitions = await all_partitions(consumer, topic)
        consumer.assign(partitions)
        await consumer.seek_to_beginning(*partitions)
        ends = await consumer.end_offsets(partitions)
        out = []
        #: the next offset each partition takes: a record handed out twice (a fetch from before the seek) is skipped,
        #: or an audit would count it twice
        taken: dict[TopicPartition, int] = {}
        idle = 0
        while idle < 3:
            batch = await consumer.getmany(timeout_ms=300)
            if not batch:
                positions = [await consumer.position(tp) for tp in partitions]
                if all(pos >= ends[tp] for pos, tp in zip(positions, partitions, strict=True)):
                    break
                idle += 1
                continue
            idle = 0
            for tp, records in batch.items():
                for record in records:
                    if record.offset < taken.get(tp, 0):
                        continue
                    taken[tp] = record.offset + 1
                    try:
                        event = codec.decode(record.value or b"")
                    except DecodeError:
                        continue
                    out.append((tp, record.offset, event, list(record.headers or ())))
        return out
    finally:
        await stop_consumer(consumer)


async def all_partitions(consumer: AIOKafkaConsumer, topic: str) -> list[TopicPartition]:
    """Every partition of ``topic``, from fresh metadata (a consumer without a subscription has none cached). A
    topic created a moment ago may take a few metadata refreshes to appear (more so after a broker restart)."""
    for attempt in range(METADATA_ATTEMPTS):
        cluster = await consumer._client.fetch_all_metadata()
        partitions = cluster.partitions_for_topic(topic)
        if partitions:
            return [TopicPartition(topic, p) for p in sorted(partitions)]
        await asyncio.sleep(0.1 * (attempt + 1))
    raise RuntimeError(f"topic {topic} does not exist (the stack manager creates it)")


class Handler(Protocol[E_contra]):
    async def __call__(self, event: E_contra, record: ConsumerRecord[bytes, bytes], /) -> None: ...


Undecodable = Callable[[ConsumerRecord[bytes, bytes], DecodeError], Awaitable[None]]


def _rewind(consumer: AIOKafkaConsumer, tp: TopicPartition, offset: int) -> None:
    """Fetch from ``offset`` again (records were fetched but not handled). A partition no longer assigned needs
    nothing: its next owner starts from the committed offset."""
    if tp in consumer.assignment():
        consumer.seek(tp, offset)


async def consume(
    consumer: AIOKafkaConsumer,
    codec: EventCodec[E],
    handle: Handler[E],
    *,
    stop: asyncio.Event,
    capacity: Callable[[], int] | None = None,
    room_freed: asyncio.Event | None = None,
    on_batch_end: Callable[[], Awaitable[None]] | None = None,
    accepts: Callable[[TopicPartition], bool] | None = None,
    undecodable: Undecodable | None = None,
    select: Callable[[], Awaitable[list[TopicPartition]]] | None = None,
    poll_timeout_ms: int = 100,
) -> None:
    """Poll ``consumer`` until ``stop`` is set; decode each record and await ``handle(event, record)``.

    Nothing fetched is ever dropped unhandled: a record is handled, or its partition is rewound to it.

    * ``capacity()`` (optional) says how many more records the caller can take now; at 0 every assigned
      partition is paused and the loop sleeps until ``room_freed`` is set (or a second passes: polling goes on
      so that the group membership stays alive).
    * ``accepts(tp)`` (optional): False while the caller cannot take a partition's records yet (a rebalance is
      being settled); its records are rewound and fetched again later.
    * A handler raising :class:`RetryLater` rewinds every partition to its first unhandled record and backs off.
    * Records that do not decode are counted and passed to ``undecodable`` (dead-lettering, telling a waiting
      client), else logged and skipped: one bad record never stops a service.
    * ``select()`` (optional) names the partitions to fetch next, in the order their records are handled (priority
      classes); the other assigned partitions stay paused.
    """
    while not stop.is_set():
        # 1. Backpressure: fetch only what the caller can take.
        room = capacity() if capacity is not None else None
        if room is not None and room <= 0:
            # Every time: a rebalance may have assigned partitions that are not paused yet.
            consumer.pause(*consumer.assignment())
            if room_freed is not None:
                room_freed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(room_freed.wait(), 1.0)
            else:
                await asyncio.sleep(0.01)
            # Keep the poll loop alive (max.poll.interval) while paused. Partitions assigned since the pause
            # above may still return records: they go back, unhandled.
            for tp, records in (await consumer.getmany(timeout_ms=0)).items():
                _rewind(consumer, tp, records[0].offset)
            continue
        order: list[TopicPartition] | None = None
        if select is not None:
            order = await select()
            wanted = set(order)
            consumer.pause(*(consumer.assignment() - wanted))
            consumer.resume(*(wanted & consumer.paused()))
        else:
            consumer.resume(*consumer.paused())
        # 2. Fetch.
        batches = await consumer.getmany(timeout_ms=poll_timeout_ms, max_records=room)
        if order is not None:
            rank = {tp: i for i, tp in enumerate(order)}
            batches = dict(sorted(batches.items(), key=lambda item: rank.get(item[0], len(rank))))
        # 3. Decode and hand over, in partition order.
        backoff = await _handle_batches(consumer, codec, handle, batches, accepts, undecodable)
        if backoff:
            await asyncio.sleep(backoff)
        if on_batch_end is not None:
            await on_batch_end()


async def _handle_batches(
    consumer: AIOKafkaConsumer,
    codec: EventCodec[E],
    handle: Handler[E],
    batches: dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]],
    accepts: Callable[[TopicPartition], bool] | None,
    undecodable: Undecodable | None,
) -> float:
    """Handle one fetch; returns how long to back off (a handler asked to retry later), else 0."""
    pending = list(batches.items())
    refused = 0.0
    while pending:
        tp, records = pending.pop(0)
        for index, record in enumerate(records):
            if accepts is not None and not accepts(tp):
                _rewind(consumer, tp, record.offset)
                refused = 0.05  # the caller is settling a rebalance: do not spin on the same records
                break
            if record.value is None:
                continue
            try:
                event = codec.decode(record.value)
            except DecodeError as exc:
                DECODE_ERRORS.labels(topic=tp.topic).inc()
                if undecodable is not None:
                    await undecodable(record, exc)
                else:
                    log.warning("undecodable record skipped", extra={
                        "topic": tp.topic, "partition": tp.partition, "offset": record.offset, "reason": str(exc)})
                continue
            try:
                await handle(event, record)
            except RetryLater as retry:
                log.warning("record handling deferred", extra={"reason": str(retry), "delay_s": retry.delay_s,
                                                               "partition": tp.partition, "offset": record.offset})
                _rewind(consumer, tp, records[index].offset)
                for other, rest in pending:
                    _rewind(consumer, other, rest[0].offset)
                return retry.delay_s
    return refused
