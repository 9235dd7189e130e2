"""``kns topics`` and ``kns tokens``: what is in Kafka, for operators.

``kns tokens`` decodes records of the token topic (Avro, via ``schemas``), so anyone can check that every token
of an answer went through Kafka.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import typer
from aiokafka import ConsumerRecord
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from runtime.cli_tables import emit_json, show
from runtime.kafka_clients import all_partitions, consume, make_consumer
from runtime.settings import KafkaSettings, load_settings
from schemas.codec import codec_for
from schemas.events import TokenEvent
from schemas.topics import TOPICS

console = Console()
err = Console(stderr=True)


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


def topics(as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table, for scripts.")) -> None:
    """The topic map, with each topic's offset range now (records plus transaction markers)."""
    kafka = load_settings().kafka
    counts = asyncio.run(_end_offsets(kafka))
    rows = [{"topic": kafka.topic(spec.name), "event": spec.event.__name__ if spec.event else "raw", "key": spec.key,
             "partitions": spec.partitions, "retention_ms": spec.retention_ms, "offsets": counts.get(spec.name),
             "producers": list(spec.producers), "consumers": list(spec.consumers)} for spec in TOPICS.all()]
    if as_json:
        emit_json(rows)
    else:
        show(console, topics_table(rows))


def topics_table(rows: list[dict[str, Any]]) -> Table:
    table = Table(title="topics")
    for column in ("topic", "event", "key", "partitions", "retention", "offsets", "producers → consumers"):
        table.add_column(column, overflow="fold" if column in ("key", "producers → consumers") else "ellipsis")
    for row in rows:
        retention = "forever" if row["retention_ms"] < 0 else f"{row['retention_ms'] / 3_600_000:g} h"
        offsets = "?" if row["offsets"] is None else str(row["offsets"])
        table.add_row(row["topic"], row["event"], row["key"], str(row["partitions"]), retention, offsets,
                      f"{', '.join(row['producers'])} → {', '.join(row['consumers'])}")
    return table


async def _read_tokens(kafka: KafkaSettings, request_id: str | None, since_s: float, follow: bool,
                       shown: Callable[[dict[str, Any]], None]) -> int:
    consumer = make_consumer(kafka, role="ops-tokens", isolation="read_uncommitted")
    await consumer.start()
    count = 0
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
            nonlocal count
            for event in packed.split():  # one record per engine step: several requests' deltas
                if request_id and event.request_id != request_id:
                    continue
                count += 1
                shown({"partition": record.partition, "offset": record.offset,
                       "time": datetime.fromtimestamp(record.timestamp / 1000, UTC).isoformat(timespec="milliseconds"),
                       "request_id": event.request_id, "attempt": event.attempt, "seq": event.seq,
                       "token_ids": event.token_ids, "text": event.text, "finish_reason": event.finish_reason})

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
    return count


def _cells(row: dict[str, Any]) -> list[str]:
    return [str(row["partition"]), str(row["offset"]), row["time"][11:23], row["request_id"], str(row["attempt"]),
            str(row["seq"]), str(row["token_ids"]), repr(row["text"]), row["finish_reason"] or ""]


def tokens_table(rows: list[dict[str, Any]], title: str) -> Table:
    table = Table(title=title)
    for column in ("partition", "offset", "time", "request", "attempt", "seq", "token ids", "text", "finish"):
        table.add_column(column, overflow="fold" if column in ("token ids", "text") else "ellipsis")
    for row in rows:
        table.add_row(*(escape(cell) for cell in _cells(row)))
    return table


def tokens(
    request_id: str | None = typer.Option(None, "--request-id", "-r", help="Only this request's events."),
    since: float = typer.Option(3600, help="Read records from this many seconds ago."),
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new records."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table, for scripts: an array, or "
                                 "with --follow one object per line as records arrive."),
) -> None:
    """Decode token events from the token topic (every token of every answer passes through it)."""
    kafka = load_settings().kafka
    rows: list[dict[str, Any]] = []

    def shown(row: dict[str, Any]) -> None:
        if not follow:
            rows.append(row)
        elif as_json:
            typer.echo(json.dumps(row))
        else:
            console.print("  ".join(_cells(row)), markup=False, highlight=False)

    count = asyncio.run(_read_tokens(kafka, request_id, since, follow, shown))
    if as_json and not follow:
        emit_json(rows)
    elif not follow:
        show(console, tokens_table(rows, kafka.topic(TOPICS.tokens.name) + (f" · {request_id}" if request_id else "")))
    (err if as_json else console).print(f"[dim]{count} token events[/dim]")
