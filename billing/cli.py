"""``kns billing``: reconcile the ledger against the usage topic, export usage, manage prices, check orgs' spend.

Errors an operator can fix (a refused price, an unreachable Cassandra) are one line on stderr and exit 1.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Coroutine
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any, TypeVar

import typer
from cassandra.cluster import Session
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from billing.export import write
from billing.ledger import Ledger, Totals, parse_instant, utc
from billing.prices import Price, PriceLead, PriceRefused, PriceStore
from billing.reconcile import ACTIONS, FINAL, Report, reconcile
from billing.replay import UsageReplay, replay_usage
from runtime.cassandra_client import connect_async
from runtime.cli_tables import emit_json, show
from runtime.redis_client import make_redis
from runtime.retry import TRANSIENT
from runtime.settings import Settings, load_settings
from runtime.spend import Spend, SpendBook, ledger_nanos, month_of, usd

T = TypeVar("T")
app = typer.Typer(help="Billing: reconcile, export, prices.", no_args_is_help=True)
console = Console()
err = Console(stderr=True, soft_wrap=True)
JSON = typer.Option(False, "--json", help="Print JSON instead of a table, for scripts.")


def _fail(message: str) -> typer.Exit:
    err.print(f"[bold red]error:[/bold red] {escape(message)}", highlight=False)
    return typer.Exit(code=1)


@asynccontextmanager
async def _cassandra(settings: Settings) -> AsyncIterator[Session]:
    cluster, session = await connect_async(settings.cassandra)
    try:
        yield session
    finally:
        await asyncio.to_thread(cluster.shutdown)


async def _store(session: Session, settings: Settings) -> PriceStore:
    lead = PriceLead(settings.processors.price_reload_s)
    return await asyncio.to_thread(PriceStore, session, settings.cassandra.keyspace, lead)


def _run(work: Coroutine[Any, Any, T]) -> T:
    """Run a command's coroutine; Cassandra or Kafka out of reach is one line and exit 1, not a traceback."""
    try:
        return asyncio.run(work)
    except TRANSIENT as exc:
        raise _fail(f"a store did not answer ({type(exc).__name__}: {exc}); is the stack up? (kns stack status)"
                    ) from exc


def _range(start: str | None, end: str | None) -> tuple[datetime, datetime]:
    try:
        finish = parse_instant(end) if end else datetime.now(UTC)
        begin = parse_instant(start) if start else finish - timedelta(days=1)
    except ValueError as exc:
        raise typer.BadParameter(f"times are ISO 8601 or Unix seconds: {exc}") from exc
    if finish <= begin:
        raise typer.BadParameter("--end must be after --start")
    return begin, finish


async def _replay(settings: Settings, start: datetime, end: datetime, *, quiet: bool = False) -> UsageReplay:
    with Progress(TextColumn("replaying usage"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err if quiet else console, transient=True) as bar:
        task = bar.add_task("replay", total=None)
        return await replay_usage(settings.kafka, start, end,
                                  progress=lambda done, total: bar.update(task, completed=done, total=total))


def _cells(t: Totals | None) -> list[str]:
    if t is None:
        return ["-", "-", "-", "-"]
    return [str(t.requests), str(t.prompt_tokens), str(t.completion_tokens), f"{t.cost:.8f}"]


def reconcile_table(report: Report) -> Table:
    table = Table(title="usage topic (expected) vs ledger, per org and model")
    for column in ("org", "model", "requests", "prompt", "completion", "cost USD", "ledger requests",
                   "ledger prompt", "ledger completion", "ledger cost USD", ""):
        table.add_column(column, justify="right" if column not in ("org", "model") else "left")
    for key in sorted(report.expected.keys() | report.actual.keys()):
        want, got = report.expected.get(key), report.actual.get(key)
        mark = "[green]ok[/green]" if want == got else "[red]DIFF[/red]"
        table.add_row(key[0], key[1], *_cells(want), *_cells(got), mark)
    return table


def show_report(report: Report, limit: int = 20) -> None:
    show(console, reconcile_table(report))
    console.print(f"{report.replayed} committed usage records, {report.duplicates} duplicates of an earlier record "
                  f"(billed once), {len(report.discrepancies)} discrepancies")
    for d in report.discrepancies[:limit]:
        fix = f"[dim](--repair: {d.repair.action})[/dim]" if d.repair else "[dim](reported only)[/dim]"
        console.print(f"  [red]{d.kind}[/red] {d.request_id}: {escape(d.detail)} {fix}")
    if len(report.discrepancies) > limit:
        console.print(f"  ... and {len(report.discrepancies) - limit} more")
    kept = Counter(d.kind for d in report.not_repairable)
    if kept:
        console.print(f"{sum(kept.values())} not repairable ({', '.join(f'{n} {k}' for k, n in sorted(kept.items()))})"
                      f": --repair never re-prices a billed row ({FINAL}) nor invents usage or prices; these need an "
                      "operator")


def _totals_json(t: Totals | None) -> dict[str, Any] | None:
    return None if t is None else {"requests": t.requests, "prompt_tokens": t.prompt_tokens,
                                   "completion_tokens": t.completion_tokens, "cached_tokens": t.cached_tokens,
                                   "cost_usd": str(t.cost)}


def report_json(report: Report, repaired: Report | None = None) -> dict[str, Any]:
    """The report as ``--json`` prints it; ``repaired``: the report of the repair run before it, if any."""
    keys = sorted(report.expected.keys() | report.actual.keys())
    out: dict[str, Any] = {
        "clean": report.clean, "replayed": report.replayed, "duplicates": report.duplicates,
        "rows": [{"org_id": org, "model": model, "expected": _totals_json(report.expected.get((org, model))),
                  "ledger": _totals_json(report.actual.get((org, model))),
                  "ok": report.expected.get((org, model)) == report.actual.get((org, model))} for org, model in keys],
        "discrepancies": [{"request_id": d.request_id, "kind": d.kind, "detail": d.detail,
                           "repair": d.repair.action if d.repair else None} for d in report.discrepancies]}
    if repaired is not None:
        out["repair"] = {"repaired": repaired.repaired, "by_action": repaired.repaired_by_action,
                         "skipped": [d.request_id for d in repaired.skipped]}
    return out


def show_repairs(report: Report) -> None:
    actions = ", ".join(f"{report.repaired_by_action.get(a, 0)} {text}" for a, text in ACTIONS.items())
    console.print(f"[yellow]repaired {report.repaired} rows[/yellow] ({actions})")
    for d in report.skipped:
        console.print(f"  [yellow]skipped[/yellow] {d.request_id}: its row changed during the repair "
                      "(billed with another version meanwhile)")


async def _reconcile(start: datetime, end: datetime, repair: bool, org: str | None, *, quiet: bool = False
                     ) -> tuple[Report, Report | None]:
    settings = load_settings()
    redis = make_redis(settings.redis)
    try:
        return await _reconcile_with(settings, SpendBook(redis, settings.redis), start, end, repair, org, quiet=quiet)
    finally:
        await redis.aclose()


async def _reconcile_with(settings: Settings, spend: SpendBook, start: datetime, end: datetime, repair: bool,
                          org: str | None, *, quiet: bool = False) -> tuple[Report, Report | None]:
    """The report, and with ``repair`` the report of the repair run it checked again after (``quiet``: nothing
    printed, for ``--json``)."""
    async with _cassandra(settings) as session:
        ledger = await Ledger.open(session, settings.cassandra.keyspace)
        prices = await (await _store(session, settings)).load()
        replay = await _replay(settings, start, end, quiet=quiet)
        report = await reconcile(ledger, prices, replay, start, end, repair=repair, org_id=org, spend=spend)
        if repair and (report.repaired or report.skipped):
            if not quiet:
                show_report(report)
                show_repairs(report)
                console.print("checking again")
            return await reconcile(ledger, prices, replay, start, end, repair=False, org_id=org), report
        if repair and not quiet:
            console.print("nothing that --repair may change")
        return report, None


@app.command("reconcile")
def reconcile_command(
    start: str | None = typer.Option(None, help="ISO 8601 or Unix seconds (default: end - 24 h)."),
    end: str | None = typer.Option(None, help="ISO 8601 or Unix seconds (default: now)."),
    repair: bool = typer.Option(
        False, "--repair", help="Bill requests missing from the ledger (at the price valid at their time), restore "
        "rows whose usage disagrees with the committed usage (cost at the version that billed the row) and rewrite "
        "views from their row. Never re-prices a billed row: rows billed with a version the price table no longer "
        "applies are reported, not changed. Idempotent."),
    org: str | None = typer.Option(None, help="Only this organisation."),
    as_json: bool = JSON,
) -> None:
    """Replay the usage topic for a range and diff it against the ledger; exit 1 on any discrepancy."""
    begin, finish = _range(start, end)
    report, repaired = _run(_reconcile(begin, finish, repair, org, quiet=as_json))
    if as_json:
        emit_json({"start": begin.isoformat(), "end": finish.isoformat(), "org_id": org,
                   **report_json(report, repaired)})
    else:
        show_report(report)
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
def prices_command(as_json: bool = JSON) -> None:
    """The price table: every version of every model's price."""

    async def load() -> list[Price]:
        settings = load_settings()
        async with _cassandra(settings) as session:
            return (await (await _store(session, settings)).load()).all()

    prices = sorted(_run(load()), key=lambda p: (p.model, p.valid_from))
    if as_json:
        emit_json([{"model": p.model, "valid_from": p.valid_from.isoformat(), "version": p.version,
                    "input_per_mtok": str(p.input_per_mtok), "cached_input_per_mtok": str(p.cached_input_per_mtok),
                    "output_per_mtok": str(p.output_per_mtok)} for p in prices])
    else:
        show(console, prices_table(prices))


def prices_table(prices: list[Price]) -> Table:
    table = Table(title="prices (USD per 1M tokens)")
    for column in ("model", "valid from", "version", "input", "cached input", "output"):
        table.add_column(column)
    for p in prices:
        table.add_row(p.model, p.valid_from.isoformat(), p.version, str(p.input_per_mtok),
                      str(p.cached_input_per_mtok), str(p.output_per_mtok))
    return table


def _money(option: str, value: str) -> Decimal:
    try:
        return Decimal(value)
    except InvalidOperation as exc:
        raise typer.BadParameter(f"{option} must be a decimal (USD per 1M tokens), not {value!r}") from exc


@app.command("set-price")
def set_price(
    model: str = typer.Option(...), version: str = typer.Option(..., help="A label, unique per model."),
    input_per_mtok: str = typer.Option(..., "--input"), output_per_mtok: str = typer.Option(..., "--output"),
    cached_input_per_mtok: str = typer.Option(..., "--cached-input"),
    valid_from: str = typer.Option(..., help="ISO 8601: requests from then on are billed at this price. At least "
                                   "the minimum lead from now (3 min with the default 60 s price reload)."),
) -> None:
    """Add a price version. Versions are never edited (an existing model + valid_from is refused) and a new one
    starts at least twice the processors' price reload interval (plus a margin) from now, so every billing
    processor has it before it applies; only a stretch the model had no price for may be priced in the past."""
    try:
        start = parse_instant(valid_from)
    except ValueError as exc:
        raise typer.BadParameter(f"--valid-from is ISO 8601 or Unix seconds: {exc}") from exc
    price = Price(model, start, version, _money("--input", input_per_mtok),
                  _money("--cached-input", cached_input_per_mtok), _money("--output", output_per_mtok))

    async def add() -> None:
        settings = load_settings()
        async with _cassandra(settings) as session:
            await (await _store(session, settings)).add(price)

    try:
        _run(add())
    except PriceRefused as exc:
        raise _fail(str(exc)) from exc
    console.print(f"price {price.describe()} added")


async def _spend(org: str, month: str, repair: bool) -> tuple[Spend, int, Spend | None]:
    settings = load_settings()
    first = datetime.strptime(month, "%Y-%m").replace(tzinfo=UTC)
    after = (first + timedelta(days=32)).replace(day=1)
    redis = make_redis(settings.redis)
    book = SpendBook(redis, settings.redis)
    try:
        async with _cassandra(settings) as session:
            ledger = await Ledger.open(session, settings.cassandra.keyspace)
            rows = await ledger.rows_for_org(org, first, after)
        billed = ledger_nanos(Decimal(r["cost"]) for r in rows)
        before = await book.read(org, month)
        if repair and before.billed_nanos != billed:
            # Charged again, row by row: what billing charged already counts once (its mark), what Redis lost
            # (sums and marks alike) is charged now, so a redelivery later is not counted twice either.
            await book.charge_all((str(r["request_id"]), org, utc(r["requested_at"]), Decimal(r["cost"]))
                                  for r in rows)
            return before, billed, await book.read(org, month)
        return before, billed, None
    finally:
        await redis.aclose()


@app.command("spend")
def spend_command(
    org: str = typer.Argument(..., help="The organisation."),
    month: str | None = typer.Option(None, help="YYYY-MM (UTC; default: this month)."),
    repair: bool = typer.Option(False, "--repair", help="Charge every ledger row of the month to the spend again "
                                "(after Redis lost its data): rows already charged count once; holds are kept."),
    as_json: bool = JSON,
) -> None:
    """An org's monthly spend as admission sees it (Redis: billed + holds in flight) against the ledger's sum;
    exit 1 when they disagree (and it was not repaired)."""
    month = month or month_of(datetime.now(UTC))
    try:
        datetime.strptime(month, "%Y-%m")
    except ValueError:
        raise typer.BadParameter("--month must be YYYY-MM") from None
    spend, ledger_nanos, repaired = _run(_spend(org, month, repair))
    agrees = (repaired or spend).billed_nanos == ledger_nanos
    if as_json:
        def side(s: Spend) -> dict[str, Any]:
            return {"billed_usd": str(usd(s.billed_nanos)), "held_usd": str(usd(s.reserved_nanos)), "holds": s.holds}

        emit_json({"org_id": org, "month": month, "redis": side(spend), "ledger_usd": str(usd(ledger_nanos)),
                   "repaired": None if repaired is None else side(repaired), "agrees": agrees})
    else:
        show(console, spend_table(org, month, spend, ledger_nanos, repaired))
    if not agrees:
        err.print("billed spend differs from the ledger: run with --repair (or wait for billing to catch up)")
    raise typer.Exit(0 if agrees else 1)


def spend_table(org: str, month: str, spend: Spend, ledger_nanos: int, repaired: Spend | None) -> Table:
    table = Table(title=f"spend of {org} in {month} (USD)")
    for column in ("", "billed", "held in flight", "requests in flight", "ledger"):
        table.add_column(column, justify="right")
    table.add_row("redis", str(usd(spend.billed_nanos)), str(usd(spend.reserved_nanos)), str(spend.holds),
                  str(usd(ledger_nanos)))
    if repaired is not None:
        table.add_row("repaired", str(usd(repaired.billed_nanos)), str(usd(repaired.reserved_nanos)),
                      str(repaired.holds), str(usd(ledger_nanos)))
    return table
