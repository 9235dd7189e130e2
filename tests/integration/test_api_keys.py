"""The API key registry in the real Cassandra."""

from __future__ import annotations

import asyncio

import pytest

from producers.gateway.keys import ApiKeyRegistry, hash_key
from runtime.cassandra_client import connect_async, execute
from runtime.settings import Settings

pytestmark = pytest.mark.integration


async def test_create_lookup_revoke(stack: Settings) -> None:
    cluster, session = await connect_async(stack.cassandra)
    try:
        registry = await ApiKeyRegistry.open(session, stack.cassandra.keyspace, cache_ttl_s=0)
        secret, key = await registry.create(org_id="org-keys", tier="free", name="t")
        assert secret.startswith("sk-kns-") and len(secret) > 40
        found = await registry.lookup(secret)
        assert found == key
        assert await registry.lookup(secret + "x") is None
        rows = await execute(session, f"SELECT key_hash FROM {stack.cassandra.keyspace}.api_keys WHERE key_hash=%s",
                             (hash_key(secret),))
        assert rows and secret not in str(rows)  # only the hash is stored
        await execute(session, f"UPDATE {stack.cassandra.keyspace}.api_keys SET revoked=true WHERE key_hash=%s",
                      (hash_key(secret),))
        assert await registry.lookup(secret) is None
    finally:
        await asyncio.to_thread(cluster.shutdown)
