"""``kns billing``: reconcile the ledger against the usage topic, export usage, manage prices."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from billing.export import write
from billing.ledger import Ledger, Totals, parse_instant
from billing.prices import Price, PriceStore
from billing.reconcile import Report, reconcile
from billing.replay import UsageReplay, replay_usage
from runtime.cassandra_client import connect_async
from runtime.settings import Settings, load_settings

app = typer.Typer(help="Billing: reconcile, export, prices.", no_args_is_help=True)
console = Console()


def _range(start: str | None, end: str | None) -> tuple[datetime, datetime]:
    try:
        finish = parse_instant(end) if end else datetime.now(UTC)
        begin = parse_instant(start) if start else finish - timedelta(days=1)
    except ValueError as exc:
        raise typer.BadParameter(f"times are ISO 8601 or Unix seconds: {exc}") from exc
    if finish <= begin:
        raise typer.BadParameter("--end must be after --start")
    return begin, finish


async def _replay(settings: Settings, start: datetime, end: datetime) -> UsageReplay:
    with Progress(TextColumn("replaying usage"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as bar:
        task = bar.add_task("replay", total=None)
        return await replay_usage(settings.kafka, start, end,
                                  progress=lambda done, total: bar.update(task, completed=done, total=total))


def _cells(t: Totals | None) -> list[str]:
    if t is None:
        return ["-", "-", "-", "-"]
    return [str(t.requests), str(t.prompt_tokens), str(t.completion_tokens), f"{t.cost:.8f}"]


def show(report: Report, limit: int = 20) -> None:
    table = Table(title="usage topic (expected) vs ledger, per org and model")
    for column in ("org", "model", "requests", "prompt", "completion", "cost USD", "ledger requests",
                   "ledger prompt", "ledger completion", "ledger cost USD", ""):
        table.add_column(column, justify="right" if column not in ("org", "model") else "left")
    for key in sorted(report.expected.keys() | report.actual.keys()):
        want, got = report.expected.get(key), report.actual.get(key)
        mark = "[green]ok[/green]" if want == got else "[red]DIFF[/red]"
        table.add_row(key[0], key[1], *_cells(want), *_cells(got), mark)
    console.print(table)
    console.print(f"{report.replayed} committed usage records, {report.duplicates} duplicates of an earlier record "
                  f"(billed once), {len(report.discrepancies)} discrepancies")
    for d in report.discrepancies[:limit]:
        console.print(f"  [red]{d.kind}[/red] {d.request_id}: {d.detail}")
    if len(report.discrepancies) > limit:
        console.print(f"  ... and {len(report.discrepancies) - limit} more")


async def _reconcile(start: datetime, end: datetime, repair: bool, org: str | None) -> Report:
    settings = load_settings()
    cluster, session = await connect_async(settings.cassandra)
    try:
        ledger = await Ledger.open(session, settings.cassandra.keyspace)
        prices = await (await asyncio.to_thread(PriceStore, session, settings.cassandra.keyspace)).load()
        replay = await _replay(settings, start, end)
        report = await reconcile(ledger, prices, replay, start, end, repair=repair, org_id=org)
        if repair and report.repaired:
            show(report)
            console.print(f"[yellow]repaired {report.repaired} rows; checking again[/yellow]")
            report = await reconcile(ledger, prices, replay, start, end, repair=False, org_id=org)
        return report
    finally:
        await asyncio.to_thread(cluster.shutdown)


@app.command("reconcile")
def reconcile_command(
    start: str | None = typer.Option(None, help="ISO 8601 or Unix seconds (default: end - 24 h)."),
    end: str | None = typer.Option(None, help="ISO 8601 or Unix seconds (default: now)."),
    repair: bool = typer.Option(False, "--repair", help="Re-apply missing or wrong ledger rows (idempotent)."),
    org: str | None = typer.Option(None, help="Only this organisation."),
) -> None:
    """Replay the usage topic for a range and diff it against the ledger; exit 1 on any discrepancy."""
    begin, finish = _range(start, end)
    report = asyncio.run(_reconcile(begin, finish, repair, org))
    show(report)
    raise typer.Exit(0 if report.clean else 1)


@app.command("export")
def export_command(
    out: Path = typer.Option(..., "--out", "-o", help="File to write."),
    fmt: str = typer.Option("parquet", "--format", "-f", help="csv or parquet"),
    start: str | None = typer.Option(None), end: str | None = typer.Option(None),
) -> None:
    """Decode the usage topic for a range into CSV or Parquet (one row per committed usage record)."""
    if fmt not in ("csv", "parquet"):
        raise typer.BadParameter("--format must be csv or parquet")
    begin, finish = _range(start, end)
    replay = asyncio.run(_replay(load_settings(), begin, finish))
    count = write(replay, out, fmt)  # type: ignore[arg-type]
    console.print(f"wrote {count} usage records to {out}")


@app.command("prices")
def prices_command() -> None:
    """The price table: every version of every model's price."""

    async def load() -> list[Price]:
        settings = load_settings()
        cluster, session = await connect_async(settings.cassandra)
        try:
            return (await (await asyncio.to_thread(PriceStore, session, settings.cassandra.keyspace)).load()).all()
        finally:
            await asyncio.to_thread(cluster.shutdown)

    table = Table(title="prices (USD per 1M tokens)")
    for column in ("model", "valid from", "version", "input", "cached input", "output"):
        table.add_column(column)
    for p in sorted(asyncio.run(load()), key=lambda p: (p.model, p.valid_from)):
        table.add_row(p.model, p.valid_from.isoformat(), p.version, str(p.input_per_mtok),
                      str(p.cached_input_per_mtok), str(p.output_per_mtok))
    console.print(table)


@app.command("set-price")
def set_price(
    model: str = typer.Option(...), version: str = typer.Option(...),
    input_per_mtok: str = typer.Option(..., "--input"), output_per_mtok: str = typer.Option(..., "--output"),
    cached_input_per_mtok: str = typer.Option(..., "--cached-input"),
    valid_from: str = typer.Option(..., help="ISO 8601: requests from then on are billed at this price."),
) -> None:
    """Add a price version (prices are never edited: past requests keep the price they had)."""

    async def add() -> None:
        settings = load_settings()
        cluster, session = await connect_async(settings.cassandra)
        try:
            store = await asyncio.to_thread(PriceStore, session, settings.cassandra.keyspace)
            await store.add(Price(model, parse_instant(valid_from), version, Decimal(input_per_mtok),
                                  Decimal(cached_input_per_mtok), Decimal(output_per_mtok)))
        finally:
            await asyncio.to_thread(cluster.shutdown)

    asyncio.run(add())
    console.print(f"price {version} for {model} valid from {valid_from} added")
