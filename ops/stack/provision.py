"""Create what the services expect to find: the topics, the Cassandra schema, the dev org with its API key and an
operator's admin key.

Every step is idempotent, so ``stack up`` runs them on every start. The price seed never edits a stored version: a
seed row that differs from the one stored fails provisioning (add a new version instead).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from string import Template

from cassandra.cluster import Session

from billing.prices import PriceLead, PriceRefused, PriceStore, load_seed
from ops.stack.services import INFRA, StackError
from producers.tenancy.admin import OPERATORS_ORG, KeyCreate, TenancyAdmin, open_admin
from runtime.cassandra_client import connect
from runtime.kafka_clients import ensure_topics
from runtime.settings import CassandraSettings, ProcessorSettings, Settings
from schemas.topics import TOPICS

DEV_ORG = "org-dev"
DEV_TIER = "plus"


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


async def seed_prices(session: Session, keyspace: str, processors: ProcessorSettings | None = None) -> None:
    """The newest seed file into the price table; idempotent. ``processors`` gives the price reload interval the
    minimum lead of a new seed version is derived from (default: the default interval)."""
    lead = PriceLead((processors or ProcessorSettings()).price_reload_s)
    store = await asyncio.to_thread(PriceStore, session, keyspace, lead)
    try:
        await store.seed(load_seed())
    except PriceRefused as exc:
        raise StackError(f"price seed refused: {exc}") from exc


async def ensure_key_file(admin: TenancyAdmin, path: Path, *, org_id: str, tier: str, key_id: str,
                          admin_key: bool = False) -> tuple[str, bool]:
    """The key whose secret is in ``path`` (mode 0600), registered in the key registry; created when the file is
    missing. A file that survived a wiped stack registers its secret again. Returns (secret, created)."""
    existing = await asyncio.to_thread(_read_key, path)
    if existing is not None:
        await admin.register_secret(org_id, tier, existing,
                                    key_id=key_id, name=path.name, admin=admin_key)
        return existing, False
    issued = await admin.issue_key(org_id, tier, KeyCreate(name=path.name, admin=admin_key))
    await asyncio.to_thread(_write_key, path, issued.secret)
    return issued.secret, True


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
        await seed_prices(session, settings.cassandra.keyspace, settings.processors)
    finally:
        await asyncio.to_thread(cluster.shutdown)
    async with open_admin(settings) as admin:
        secret, new = await ensure_key_file(admin, settings.stack.dev_key_file, org_id=DEV_ORG, tier=DEV_TIER,
                                            key_id="key_dev")
        await ensure_key_file(admin, settings.stack.dev_admin_key_file, org_id=OPERATORS_ORG, tier="enterprise",
                              key_id="key_dev_admin", admin_key=True)
    return created, secret, new
