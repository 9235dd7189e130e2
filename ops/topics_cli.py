"""``kns topics`` and ``kns tokens``: what is in Kafka, for operators.

``kns tokens`` decodes records of the token topic (Avro, via ``schemas``), so anyone can check that every token
of an answer went through Kafka.
"""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime

import typer
from aiokafka import ConsumerRecord
from rich.console import Console
from rich.table import Table

from runtime.kafka_clients import all_partitions, consume, make_consumer
from runtime.settings import KafkaSettings, load_settings
from schemas.codec import codec_for
from schemas.events import TokenEvent
from schemas.topics import TOPICS

console = Console()


async def _end_offsets(kafka: KafkaSettings) -> dict[str, int]:
    consumer = make_consumer(kafka, role="ops-topics")
    await consumer.start()
    try:
        counts = {}
        for spec in TOPICS.all():
            partitions = await all_partitions(consumer, kafka.topic(spec.name))
            ends = await consumer.end_offsets(partitions)
            starts = await consumer.beginning_offsets(partitions)
            counts[spec.name] = sum(ends[tp] - starts[tp] for tp in partitions)
        return counts
    finally:
        await consumer.stop()


def topics() -> None:
    """The topic map, with each topic's offset range now (records plus transaction markers)."""
    kafka = load_settings().kafka
    counts = asyncio.run(_end_offsets(kafka))
    table = Table(title="topics")
    for column in ("topic", "event", "key", "partitions", "retention", "offsets", "producers → consumers"):
        table.add_column(column)
    for spec in TOPICS.all():
        retention = "forever" if spec.retention_ms < 0 else f"{spec.retention_ms / 3_600_000:g} h"
        event = spec.event.__name__ if spec.event else "raw"
        table.add_row(kafka.topic(spec.name), event, spec.key, str(spec.partitions), retention,
                      str(counts.get(spec.name, "?")), f"{', '.join(spec.producers)} → {', '.join(spec.consumers)}")
    console.print(table)


async def _read_tokens(kafka: KafkaSettings, request_id: str | None, since_s: float, follow: bool,
                       table: Table | None) -> int:
    consumer = make_consumer(kafka, role="ops-tokens", isolation="read_uncommitted")
    await consumer.start()
    shown = 0
    try:
        partitions = await all_partitions(consumer, kafka.topic(TOPICS.tokens.name))
        consumer.assign(partitions)
        found = await consumer.offsets_for_times({tp: int((time.time() - since_s) * 1000) for tp in partitions})
        for tp in partitions:
            hit = found.get(tp)
            if hit is None:
                await consumer.seek_to_end(tp)
            else:
                consumer.seek(tp, hit.offset)
        ends = await consumer.end_offsets(partitions)
        stop = asyncio.Event()

        async def show(packed: TokenEvent, record: ConsumerRecord[bytes, bytes]) -> None:
            nonlocal shown
            for event in packed.split():  # one record per engine step: several requests' deltas
                if request_id and event.request_id != request_id:
                    continue
                shown += 1
                row = (str(record.partition), str(record.offset),
                       datetime.fromtimestamp(record.timestamp / 1000, UTC).strftime("%H:%M:%S.%f")[:-3],
                       event.request_id, str(event.attempt), str(event.seq), str(event.token_ids), repr(event.text),
                       event.finish_reason or "")
                if table is not None:
                    table.add_row(*row)
                else:
                    console.print("  ".join(row))

        async def caught_up() -> None:
            if follow:
                return
            for tp in partitions:
                if await consumer.position(tp) < ends[tp]:
                    return
            stop.set()

        await caught_up()
        await consume(consumer, codec_for(TokenEvent), show, stop=stop, on_batch_end=caught_up)
    finally:
        await consumer.stop()
    return shown


def tokens(
    request_id: str | None = typer.Option(None, "--request-id", "-r", help="Only this request's events."),
    since: float = typer.Option(3600, help="Read records from this many seconds ago."),
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new records."),
) -> None:
    """Decode token events from the token topic (every token of every answer passes through it)."""
    kafka = load_settings().kafka
    table = None
    if not follow:
        table = Table(title=f"{kafka.topic(TOPICS.tokens.name)}" + (f" · {request_id}" if request_id else ""))
        for column in ("partition", "offset", "time", "request", "attempt", "seq", "token ids", "text", "finish"):
            table.add_column(column)
    shown = asyncio.run(_read_tokens(kafka, request_id, since, follow, table))
    if table is not None:
        console.print(table)
    console.print(f"[dim]{shown} token events[/dim]")
