"""The API key registry (SHA-256 hashes of keys in Cassandra, each with its organisation and tier) and the
suspensions the abuse detector imposes on keys.

Keys are 256-bit random secrets, so one unsalted SHA-256 is the right hash (a slow password hash protects
low-entropy secrets; these are not). The secret is shown once, when it is created.
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import time
from dataclasses import dataclass

from cassandra.cluster import Session
from redis.asyncio import Redis

from runtime.cassandra_client import execute
from runtime.redis_client import key as redis_key
from runtime.settings import RedisSettings
from schemas.events import utcnow

KEY_PREFIX = "sk-kns-"


@dataclass(frozen=True)
class ApiKey:
    key_id: str
    org_id: str
    tier: str
    name: str


def hash_key(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def new_secret() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


class ApiKeyRegistry:
    def __init__(self, session: Session, keyspace: str, *, cache_ttl_s: float = 30.0) -> None:
        self._session = session
        self._keyspace = keyspace
        self._ttl = cache_ttl_s
        self._cache: dict[str, tuple[float, ApiKey | None]] = {}
        self._lookup_stmt = session.prepare(
            f"SELECT key_id, org_id, tier, name, revoked FROM {keyspace}.api_keys WHERE key_hash = ?"
        )
        self._insert_stmt = session.prepare(
            f"INSERT INTO {keyspace}.api_keys (key_hash, key_id, org_id, tier, name, created_at, revoked) "
            "VALUES (?, ?, ?, ?, ?, ?, false)"
        )

    @classmethod
    async def open(cls, session: Session, keyspace: str, *, cache_ttl_s: float = 30.0) -> ApiKeyRegistry:
        # Preparing statements is a blocking round trip: keep it off the event loop.
        return await asyncio.to_thread(cls, session, keyspace, cache_ttl_s=cache_ttl_s)

    async def create(self, *, org_id: str, tier: str, name: str) -> tuple[str, ApiKey]:
        secret = new_secret()
        key = ApiKey(key_id="key_" + secrets.token_hex(6), org_id=org_id, tier=tier, name=name)
        await execute(
            self._session, self._insert_stmt,
            (hash_key(secret), key.key_id, key.org_id, key.tier, key.name, utcnow()),
        )
        return secret, key

    async def lookup(self, secret: str) -> ApiKey | None:
        digest = hash_key(secret)
        now = time.monotonic()
        cached = self._cache.get(digest)
        if cached is not None and cached[0] > now:
            return cached[1]
        rows = await execute(self._session, self._lookup_stmt, (digest,))
        key = None
        if rows and not rows[0]["revoked"]:
            row = rows[0]
            key = ApiKey(key_id=row["key_id"], org_id=row["org_id"], tier=row["tier"], name=row["name"] or "")
        if len(self._cache) > 10_000:
            self._cache.clear()
        self._cache[digest] = (now + self._ttl, key)
        return key


class KeySuspensions:
    """Suspended keys: Cassandra is the record, Redis the cache every gateway reads on each request."""

    def __init__(self, session: Session, keyspace: str, redis: Redis, redis_settings: RedisSettings) -> None:
        self._session = session
        self._redis = redis
        self._redis_settings = redis_settings
        self._insert = session.prepare(
            f"INSERT INTO {keyspace}.key_suspensions (key_id, org_id, reason, alert_id, suspended_at) "
            "VALUES (?, ?, ?, ?, ?)")
        self._delete = session.prepare(f"DELETE FROM {keyspace}.key_suspensions WHERE key_id = ?")
        self._all = f"SELECT key_id, org_id, reason, alert_id, suspended_at FROM {keyspace}.key_suspensions"

    @classmethod
    async def open(cls, session: Session, keyspace: str, redis: Redis, redis_settings: RedisSettings
                   ) -> KeySuspensions:
        return await asyncio.to_thread(cls, session, keyspace, redis, redis_settings)

    def _cache_key(self, key_id: str) -> str:
        return redis_key(self._redis_settings, "suspended", key_id)

    async def suspend(self, key_id: str, org_id: str, reason: str, alert_id: str) -> None:
        """Idempotent: suspending a suspended key rewrites the same record."""
        await execute(self._session, self._insert, (key_id, org_id, reason, alert_id, utcnow()))
        await self._redis.set(self._cache_key(key_id), reason)

    async def lift(self, key_id: str) -> bool:
        was = await self._redis.delete(self._cache_key(key_id))
        await execute(self._session, self._delete, (key_id,))
        return bool(was)

    async def reason(self, key_id: str) -> str | None:
        value = await self._redis.get(self._cache_key(key_id))
        return None if value is None else str(value)

    async def all(self) -> list[dict[str, object]]:
        return await execute(self._session, self._all)

    async def sync_cache(self) -> int:
        """Make Redis say what Cassandra says (after a Redis restart, at processor start)."""
        rows = await self.all()
        for row in rows:
            await self._redis.set(self._cache_key(str(row["key_id"])), str(row["reason"]))
        return len(rows)
