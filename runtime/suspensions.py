"""The suspensions the abuse detector imposes on API keys: Cassandra is the record, Redis the cache every gateway
reads. Shared by the gateways (which refuse a suspended key), the abuse detector (which suspends) and ``kns keys``
(which lifts), so it lives here, below all three.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import math
import time
from collections.abc import Callable

from cassandra.cluster import Session
from redis.asyncio import Redis
from redis.exceptions import RedisError

from runtime.cassandra_client import execute
from runtime.redis_client import key as redis_key
from runtime.settings import RedisSettings
from schemas.events import utcnow

log = logging.getLogger(__name__)


class KeySuspensions:
    """Suspended keys: Cassandra is the record, Redis the cache every gateway reads, and each gateway remembers
    an answer for ``remember_s`` from the moment its read began: a key's requests share one Redis read per
    interval (and the requests that come while it is under way wait for it) instead of a read each, so a
    suspension takes effect on every gateway within ``remember_s`` of reaching Redis.

    Once started (:meth:`start`), it reads again, in the background and in one round trip, the answers
    of the keys used within ``keep_s`` before they are ``remember_s`` old: a key in use never waits for Redis on
    its request's path (a Redis round trip off every request's time to first token), and the bound above holds
    as it is, since only answers younger than ``remember_s`` are ever used. While Redis does not answer, the
    answers age out and the requests read for themselves (and meet the outage as before)."""

    def __init__(self, session: Session, keyspace: str, redis: Redis, redis_settings: RedisSettings,
                 remember_s: float = 0.25, keep_s: float = 10.0, refresh_max_keys: int = 1000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._session = session
        #: the ages of answers and of askings (a test passes its event loop's virtual clock)
        self._clock = clock
        self._redis = redis
        self._redis_settings = redis_settings
        self._remember_s = remember_s
        self._keep_s = keep_s
        self._refresh_max_keys = refresh_max_keys
        #: key id -> (when the read that gave the answer began, the answer)
        self._known: dict[str, tuple[float, str | None]] = {}
        #: key id -> the read under way (when it began, its answer to come)
        self._reading: dict[str, tuple[float, asyncio.Future[str | None]]] = {}
        #: key id -> when a request last asked (the keys kept fresh; recorded only while the refresher runs)
        self._asked: dict[str, float] = {}
        self._asking = False
        self._refresher: asyncio.Task[None] | None = None
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
        self._known[key_id] = (self._clock(), reason)

    async def lift(self, key_id: str) -> bool:
        was = await self._redis.delete(self._cache_key(key_id))
        await execute(self._session, self._delete, (key_id,))
        self._known[key_id] = (self._clock(), None)
        return bool(was)

    async def reason(self, key_id: str) -> str | None:
        """Why the key is suspended (None: it is not). Raises what Redis raises when there is no recent answer."""
        now = self._clock()
        if self._asking:
            self._asked[key_id] = now
        known = self._known.get(key_id)
        if known is not None and now - known[0] < self._remember_s:
            return known[1]
        reading = self._reading.get(key_id)
        if reading is None or now - reading[0] >= self._remember_s:
            # none under way, or one begun too long ago for its answer to be used: a read of this request's own
            reading = self._reading[key_id] = (now, asyncio.ensure_future(self._read(key_id, now)))
        # shielded: one caller that leaves must not cancel the read the others wait for
        return await asyncio.shield(reading[1])

    async def _read(self, key_id: str, started: float) -> str | None:
        try:
            value = await self._redis.get(self._cache_key(key_id))
        finally:
            if self._reading.get(key_id, (None,))[0] == started:
                del self._reading[key_id]
        self._forget_old()
        return self._learn(key_id, started, value)

    def _learn(self, key_id: str, started: float, value: object) -> str | None:
        """Remember what a read begun at ``started`` found, unless a newer answer is known already (a suspension or
        lift made here while it was under way: Redis may have answered before the change; or a later read)."""
        known = self._known.get(key_id)
        if known is not None and known[0] >= started:
            return known[1]
        reason = None if value is None else str(value)
        self._known[key_id] = (started, reason)
        return reason

    def last_known(self, key_id: str) -> str | None:
        """Why the key was suspended when this gateway last read it, however long ago (None: not, or never read):
        while Redis is down, a key known suspended here stays refused (``deps.authenticate``)."""
        known = self._known.get(key_id)
        return None if known is None else known[1]

    def _forget_old(self) -> None:
        """Keep the memory bounded by the keys seen within the last interval, and the suspended ones (few) seen
        at all (for :meth:`last_known`)."""
        if len(self._known) < 4096:
            return
        cutoff = self._clock() - self._remember_s
        for key_id in [k for k, (at, reason) in self._known.items() if at < cutoff and reason is None]:
            del self._known[key_id]

    def start(self) -> None:
        """Keep the answers of the keys in use fresh, in the background, until :meth:`stop` (see the class)."""
        if self._refresher is None:
            self._asking = True
            self._refresher = asyncio.create_task(self._refresh_ahead(), name="suspension-refresh")

    async def stop(self) -> None:
        refresher, self._refresher = self._refresher, None
        if refresher is not None:
            refresher.cancel()
            await asyncio.gather(refresher, return_exceptions=True)
        self._asking = False
        self._asked.clear()

    async def _refresh_ahead(self) -> None:
        every = self._remember_s / 2
        while True:
            await asyncio.sleep(every)
            try:
                await self.refresh(older_than=every)
            except (RedisError, OSError) as exc:  # the requests read for themselves meanwhile
                log.debug("suspension refresh failed", extra={"reason": repr(exc)})
            except Exception:  # never the end of the refresher: the requests would wait for Redis from then on
                log.exception("suspension refresh failed")

    async def refresh(self, *, older_than: float) -> int:
        """Read again, in one round trip, the answers of the keys asked for within ``keep_s`` that are at least
        ``older_than`` old, the ``refresh_max_keys`` most recently asked (the others read for themselves); returns
        how many were read."""
        now = self._clock()
        for key_id in [k for k, at in self._asked.items() if now - at > self._keep_s]:
            del self._asked[key_id]
        stale = [k for k in self._asked if now - self._known.get(k, (-math.inf, None))[0] >= older_than]
        if len(stale) > self._refresh_max_keys:
            stale = heapq.nlargest(self._refresh_max_keys, stale, key=self._asked.__getitem__)
        if not stale:
            return 0
        started = self._clock()
        async with self._redis.pipeline(transaction=False) as pipe:
            for key_id in stale:
                pipe.get(self._cache_key(key_id))
            values = await pipe.execute()
        for key_id, value in zip(stale, values, strict=True):
            self._learn(key_id, started, value)
        return len(stale)

    async def all(self) -> list[dict[str, object]]:
        return await execute(self._session, self._all)

    async def sync_cache(self) -> int:
        """Make Redis say what Cassandra says (after a Redis restart, at processor start)."""
        rows = await self.all()
        for row in rows:
            await self._redis.set(self._cache_key(str(row["key_id"])), str(row["reason"]))
        return len(rows)
