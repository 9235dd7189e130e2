"""``kns keys``: create API keys (the secret is printed once; only its hash is stored)."""

from __future__ import annotations

import asyncio

import typer
from rich.console import Console
from rich.table import Table

from producers.gateway.keys import ApiKey, ApiKeyRegistry, KeySuspensions
from runtime.cassandra_client import connect_async
from runtime.redis_client import make_redis
from runtime.settings import load_settings

app = typer.Typer(help="API keys.", no_args_is_help=True)
console = Console()


async def _create(org: str, tier: str, name: str) -> tuple[str, ApiKey]:
    settings = load_settings()
    cluster, session = await connect_async(settings.cassandra)
    try:
        registry = await ApiKeyRegistry.open(session, settings.cassandra.keyspace)
        return await registry.create(org_id=org, tier=tier, name=name)
    finally:
        await asyncio.to_thread(cluster.shutdown)


@app.command()
def create(
    org: str = typer.Option(..., help="Organisation the key bills to."),
    tier: str = typer.Option("free", help="Service tier (free, pro, enterprise)."),
    name: str = typer.Option("", help="A label for humans."),
) -> None:
    """Create a key and print its secret (shown once)."""
    secret, key = asyncio.run(_create(org, tier, name))
    console.print(f"key_id={key.key_id} org={key.org_id} tier={key.tier}")
    console.print(secret)


async def _suspensions(action: str, key_id: str | None = None) -> object:
    settings = load_settings()
    cluster, session = await connect_async(settings.cassandra)
    redis = make_redis(settings.redis)
    try:
        suspensions = await KeySuspensions.open(session, settings.cassandra.keyspace, redis, settings.redis)
        if action == "lift":
            assert key_id is not None
            return await suspensions.lift(key_id)
        return await suspensions.all()
    finally:
        await redis.aclose()
        await asyncio.to_thread(cluster.shutdown)


@app.command()
def unsuspend(key_id: str = typer.Argument(..., help="The key_id of a suspended key.")) -> None:
    """Lift a suspension imposed by the abuse detector: the key works again at once."""
    lifted = asyncio.run(_suspensions("lift", key_id))
    console.print(f"{key_id}: " + ("suspension lifted" if lifted else "was not suspended"))


@app.command()
def suspended() -> None:
    """List suspended keys and why."""
    rows = asyncio.run(_suspensions("list"))
    table = Table(title="suspended keys")
    for column in ("key_id", "org_id", "reason", "alert_id", "since"):
        table.add_column(column)
    for row in rows:  # type: ignore[attr-defined]
        table.add_row(row["key_id"], row["org_id"], row["reason"], row["alert_id"], str(row["suspended_at"]))
    console.print(table)
