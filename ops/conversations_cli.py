"""``kns conversations``: operator jobs on stored conversations. ``purge`` removes the rows of conversations deleted
longer ago than the retention period (deleted ones already answer 404; this frees their storage). Idempotent: run
it daily, e.g. from cron; a run that crashed is finished by the next."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import typer
from rich.console import Console
from rich.table import Table

from runtime.cassandra_client import connect_async
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
) -> None:
    """Remove every row of the conversations deleted more than --after-days ago."""
    started = datetime.now(UTC)
    purged = asyncio.run(_purge(after_days * 86400))
    table = Table(title="conversation purge")
    for column in ("deleted before", "purged", "seconds"):
        table.add_column(column)
    table.add_row((started - timedelta(days=after_days)).isoformat(timespec="seconds"), str(purged),
                  f"{(datetime.now(UTC) - started).total_seconds():.1f}")
    console.print(table)
