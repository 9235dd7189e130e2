"""``kns conversations``: operator jobs on stored conversations. ``purge`` removes the rows of conversations deleted
longer ago than the retention period (deleted ones already answer 404; this frees their storage). Idempotent: run
it daily, e.g. from cron; a run that crashed is finished by the next."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from runtime.cassandra_client import connect_async
from runtime.cli_tables import emit_json, show
from runtime.settings import load_settings
from stream_processors.store.conversations import PURGE_AFTER_S, ConversationStore

app = typer.Typer(help="Conversations: purge deleted ones.", no_args_is_help=True)
console = Console()


async def _purge(after_s: float) -> int:
    settings = load_settings()
    cluster, session = await connect_async(settings.cassandra)
    try:
        store = await ConversationStore.open(session, settings.cassandra.keyspace)
        return await store.purge(after_s=after_s)
    finally:
        await asyncio.to_thread(cluster.shutdown)


@app.command()
def purge(
    after_days: float = typer.Option(PURGE_AFTER_S / 86400, min=0,
                                     help="Purge conversations deleted more than this many days ago."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table, for scripts."),
) -> None:
    """Remove every row of the conversations deleted more than --after-days ago."""
    started = datetime.now(UTC)
    purged = asyncio.run(_purge(after_days * 86400))
    result: dict[str, Any] = {"deleted_before": (started - timedelta(days=after_days)).isoformat(timespec="seconds"),
                              "purged": purged, "seconds": round((datetime.now(UTC) - started).total_seconds(), 1)}
    if as_json:
        emit_json(result)
        return
    table = Table(title="conversation purge")
    for column in ("deleted before", "purged", "seconds"):
        table.add_column(column)
    table.add_row(result["deleted_before"], str(purged), f"{result['seconds']:.1f}")
    show(console, table)
