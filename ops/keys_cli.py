"""``kns keys``: create API keys (the secret is printed once; only its hash is stored)."""

from __future__ import annotations

import asyncio

import typer
from rich.console import Console

from producers.gateway.keys import ApiKey, ApiKeyRegistry
from runtime.cassandra_client import connect_async
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
