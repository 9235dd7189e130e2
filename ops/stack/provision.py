"""Create what the services expect to find: the topics, the Cassandra schema, the dev API key.

Every step is idempotent, so ``stack up`` runs them on every start.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from string import Template

from cassandra.cluster import Session

from billing.prices import PriceStore, load_seed
from ops.stack.services import INFRA
from producers.gateway.keys import ApiKeyRegistry, hash_key
from runtime.cassandra_client import connect, execute
from runtime.kafka_clients import ensure_topics
from runtime.settings import CassandraSettings, Settings
from schemas.topics import TOPICS

DEV_ORG = "org-dev"
DEV_TIER = "pro"


def schema_statements(cassandra: CassandraSettings) -> list[str]:
    text = Template((INFRA / "cassandra" / "schema.cql").read_text()).substitute(
        keyspace=cassandra.keyspace, replication_factor=cassandra.replication_factor
    )
    lines = [line for line in text.splitlines() if not line.strip().startswith("--")]
    return [stmt.strip() for stmt in "\n".join(lines).split(";") if stmt.strip()]


def apply_schema(cassandra: CassandraSettings) -> None:
    """Blocking (schema changes wait for agreement); run it in a thread from async code."""
    cluster, session = connect(cassandra)
    try:
        for statement in schema_statements(cassandra):
            session.execute(statement, timeout=60)
    finally:
        cluster.shutdown()


async def seed_prices(session: Session, keyspace: str) -> None:
    store = await asyncio.to_thread(PriceStore, session, keyspace)
    await store.seed(load_seed())


async def ensure_dev_key(session: Session, settings: Settings) -> tuple[str, bool]:
    """The dev key from ``.local/dev-api-key``, registered in Cassandra; created when missing.

    Returns (secret, created). The file is written with mode 0600.
    """
    path: Path = settings.stack.dev_key_file
    registry = await ApiKeyRegistry.open(session, settings.cassandra.keyspace)
    existing = await asyncio.to_thread(_read_key, path)
    if existing is not None:
        secret = existing
        if await registry.lookup(secret) is not None:
            return secret, False
        # The file survived but the keyspace is new (wiped or renamed): register the same secret again.
        await execute(
            session,
            f"INSERT INTO {settings.cassandra.keyspace}.api_keys "
            "(key_hash, key_id, org_id, tier, name, revoked) VALUES (%s, %s, %s, %s, %s, false)",
            (hash_key(secret), "key_dev", DEV_ORG, DEV_TIER, "dev"),
        )
        return secret, False
    secret, _key = await registry.create(org_id=DEV_ORG, tier=DEV_TIER, name="dev")
    await asyncio.to_thread(_write_key, path, secret)
    return secret, True


def _read_key(path: Path) -> str | None:
    return path.read_text().strip() if path.exists() else None


def _write_key(path: Path, secret: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")


async def provision(settings: Settings) -> tuple[list[str], str, bool]:
    """Topics, schema, price seed and dev key. Returns (topics created, dev key, whether the key is new)."""
    created = await ensure_topics(settings.kafka, TOPICS.all())
    await asyncio.to_thread(apply_schema, settings.cassandra)
    cluster, session = await asyncio.to_thread(connect, settings.cassandra)
    try:
        await seed_prices(session, settings.cassandra.keyspace)
        secret, new = await ensure_dev_key(session, settings)
    finally:
        await asyncio.to_thread(cluster.shutdown)
    return created, secret, new
