"""Read the usage topic back for a time range: the input of reconcile and export.

A fresh consumer group (nobody else's offsets move), ``read_committed`` (aborted worker transactions are not usage),
and a fixed end: the end offsets when the replay starts. Records are selected by the request's time
(``requested_at``); the read starts a little before the range because a request finishes after it starts.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from aiokafka import ConsumerRecord, TopicPartition

from runtime.kafka_clients import all_partitions, consume, make_consumer, stop_consumer
from runtime.settings import KafkaSettings
from schemas.codec import codec_for
from schemas.events import UsageEvent
from schemas.topics import TOPICS

#: how long a request may run: usage records of requests started in range are looked for this much earlier
MAX_REQUEST_AGE = timedelta(hours=1)

STALL_S = 3.0
Progress = Callable[[int, int], None]  # (records read so far, records to read)


@dataclass
class UsageReplay:
    """Every committed usage record of the range, and the first one per request id (the one that bills)."""

    records: list[tuple[int, int, UsageEvent]] = field(default_factory=list)
    first: dict[str, UsageEvent] = field(default_factory=dict)
    scanned: int = 0

    @property
    def duplicates(self) -> int:
        return len(self.records) - len(self.first)

    def only_org(self, org_id: str) -> UsageReplay:
        records = [r for r in self.records if r[2].org_id == org_id]
        return UsageReplay(records, {k: v for k, v in self.first.items() if v.org_id == org_id}, self.scanned)


async def replay_usage(kafka: KafkaSettings, start: datetime, end: datetime,
                       progress: Progress | None = None) -> UsageReplay:
    consumer = make_consumer(kafka, role="usage-replay", group=f"usage-replay-{uuid.uuid4().hex[:8]}",
                             max_partition_fetch_bytes=8 * 1024 * 1024)
    await consumer.start()
    replay = UsageReplay()
    try:
        partitions = await all_partitions(consumer, kafka.topic(TOPICS.usage.name))
        consumer.assign(partitions)
        ends = await consumer.end_offsets(partitions)
        since = int((start - MAX_REQUEST_AGE).timestamp() * 1000)
        found = await consumer.offsets_for_times({tp: since for tp in partitions})
        firsts: dict[TopicPartition, int] = {}
        for tp in partitions:
            hit = found.get(tp)
            firsts[tp] = hit.offset if hit is not None else ends[tp]
            consumer.seek(tp, firsts[tp])
        total = sum(ends[tp] - firsts[tp] for tp in partitions)
        stop = asyncio.Event()

        async def take(event: UsageEvent, record: ConsumerRecord[bytes, bytes]) -> None:
            replay.scanned += 1
            if start <= event.requested_at < end:
                replay.records.append((record.partition, record.offset, event))
                replay.first.setdefault(event.request_id, event)

        last_change = [time.monotonic(), -1]

        async def at_end() -> None:
            done = 0
            for tp in partitions:
                done += min(await consumer.position(tp), ends[tp]) - firsts[tp]
            if progress is not None:
                progress(done, total)
            if done != last_change[1]:
                last_change[:] = [time.monotonic(), done]
            # The end, or a transaction still open at the end (read_committed cannot pass it): what is beyond
            # it is not committed usage yet.
            if done >= total or time.monotonic() - last_change[0] > STALL_S:
                stop.set()

        await at_end()
        await consume(consumer, codec_for(UsageEvent), take, stop=stop, on_batch_end=at_end, poll_timeout_ms=200)
    finally:
        await stop_consumer(consumer)
    return replay
