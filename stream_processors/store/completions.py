"""Stored chat completions in Cassandra: written by the store processor, read by every gateway.

Tables (``infra/local/cassandra/schema.cql``): ``stored_completions`` (one row per id, the record of truth) and
``stored_completions_by_org`` (the listing: per org and month, newest first, with the model and metadata a listing
filters on). Every statement runs at LOCAL_QUORUM. A write is ``INSERT ... IF NOT EXISTS`` with a TTL: the first
copy of a redelivered record wins and a deleted completion stays deleted. The index row is written first (an
upsert), so a crash between the two writes leaves an index row whose completion row the redelivery then writes; a
listing reads the completion rows of its page and skips what is missing or deleted.
"""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson
from cassandra.cluster import Session

from runtime.cassandra_client import execute
from runtime.cassandra_client import prepare as prepare_at_quorum
from schemas.events import StoredCompletion, utcnow

#: how long a stored completion is kept (OpenAI keeps them 30 days)
RETENTION_S = 30 * 24 * 3600
#: how many index rows one list request reads at most while it filters (metadata, model)
SCAN_LIMIT = 2000
#: index rows read per query while a filter is on (one slice of one partition)
FILTER_BATCH = 500
#: completion rows one list request reads at once
GET_PARALLEL = 16

_COLUMNS = ("completion_id", "org_id", "key_id", "user_id", "model", "created_at", "messages", "metadata",
            "content", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "error")


def month_of(at: datetime) -> str:
    return at.astimezone(UTC).strftime("%Y-%m")


def months_within(now: datetime, seconds: float) -> list[str]:
    """The index months that can hold a row created in the last ``seconds`` before ``now``, oldest first."""
    months, at = [], (now - timedelta(seconds=seconds)).astimezone(UTC).replace(day=1)
    while (month := month_of(at)) <= month_of(now):
        months.append(month)
        at = (at + timedelta(days=32)).replace(day=1)
    return months


@dataclass(frozen=True)
class Page:
    items: list[dict[str, Any]]
    has_more: bool


class CompletionStore:
    def __init__(self, session: Session, keyspace: str) -> None:
        self._session = session
        ks = keyspace

        prepare = functools.partial(prepare_at_quorum, session)
        self._insert = prepare(f"INSERT INTO {ks}.stored_completions ({', '.join(_COLUMNS)}) "
                               f"VALUES ({', '.join('?' * len(_COLUMNS))}) IF NOT EXISTS USING TTL {RETENTION_S}")
        self._index = prepare(f"INSERT INTO {ks}.stored_completions_by_org (org_id, month, created_at, "
                              f"completion_id, model, metadata_json) VALUES (?, ?, ?, ?, ?, ?) USING TTL {RETENTION_S}")
        self._get = prepare(f"SELECT {', '.join(_COLUMNS)}, deleted_at FROM {ks}.stored_completions "
                            "WHERE completion_id = ?")
        self._delete = prepare(f"UPDATE {ks}.stored_completions USING TTL {RETENTION_S} SET deleted_at = ? "
                               "WHERE completion_id = ? IF EXISTS")
        self._unindex = prepare(f"DELETE FROM {ks}.stored_completions_by_org WHERE org_id = ? AND month = ? "
                                "AND created_at = ? AND completion_id = ?")
        base = (f"SELECT created_at, completion_id, model, metadata_json FROM {ks}.stored_completions_by_org "
                "WHERE org_id = ? AND month = ?")
        self._newest = prepare(f"{base} LIMIT ?")
        self._older = prepare(f"{base} AND (created_at, completion_id) < (?, ?) LIMIT ?")
        self._oldest = prepare(f"{base} ORDER BY created_at ASC, completion_id ASC LIMIT ?")
        self._newer = prepare(f"{base} AND (created_at, completion_id) > (?, ?) "
                              "ORDER BY created_at ASC, completion_id ASC LIMIT ?")

    @classmethod
    async def open(cls, session: Session, keyspace: str) -> CompletionStore:
        return await asyncio.to_thread(cls, session, keyspace)

    # --- writes (the store processor) -------------------------------------------------------------------

    async def write(self, stored: StoredCompletion) -> bool:
        """Store one completion (idempotent). False: it was there already (a redelivery, or deleted since)."""
        await execute(self._session, self._index, [stored.org_id, month_of(stored.created_at), stored.created_at,
                                                   stored.completion_id, stored.model,
                                                   orjson.dumps(stored.metadata, option=orjson.OPT_SORT_KEYS).decode()])
        messages = orjson.dumps([m.model_dump(exclude_none=True) for m in stored.messages]).decode()
        result = await execute(self._session, self._insert, [
            stored.completion_id, stored.org_id, stored.key_id, stored.user, stored.model, stored.created_at,
            messages, stored.metadata, stored.text, stored.finish_reason, stored.usage.prompt_tokens,
            stored.usage.completion_tokens, stored.usage.cached_tokens, stored.error])
        return bool(result[0]["[applied]"])

    # --- reads and deletes (the gateways) -----------------------------------------------------------------

    async def get(self, completion_id: str, org_id: str) -> dict[str, Any] | None:
        """The row of an org's live stored completion; None when unknown, another org's or deleted."""
        rows = await execute(self._session, self._get, [completion_id])
        if not rows or rows[0]["org_id"] != org_id or rows[0]["deleted_at"] is not None:
            return None
        return rows[0]

    async def delete(self, completion_id: str, org_id: str) -> bool:
        row = await self.get(completion_id, org_id)
        if row is None:
            return False
        await execute(self._session, self._delete, [utcnow(), completion_id])
        await execute(self._session, self._unindex, [org_id, month_of(row["created_at"].replace(tzinfo=UTC)),
                                                     row["created_at"], completion_id])
        return True

    async def page(self, org_id: str, *, after: str | None, limit: int, ascending: bool, model: str | None,
                   metadata: dict[str, str]) -> Page:
        """An org's stored completions, newest first (or oldest), after the completion ``after``; filtered by
        model and metadata. ``after`` must be one of the org's live completions (else ``KeyError``).

        The filter is judged on the index rows (they carry the model and the metadata), so the completion rows read
        are those of the page (``limit`` + 1, ``GET_PARALLEL`` at a time), plus any found deleted meanwhile. An
        index row written before the index carried metadata (30 days after the upgrade, none is left) is judged on
        its completion row. At most ``SCAN_LIMIT`` index rows are read."""
        cursor = None
        if after is not None:
            row = await self.get(after, org_id)
            if row is None:
                raise KeyError(after)
            cursor = (row["created_at"], after)
        months = months_within(utcnow(), RETENTION_S)
        if not ascending:
            months.reverse()
        filtered = model is not None or bool(metadata)
        found: list[dict[str, Any]] = []
        scanned = 0
        for month in months:  # a cursor in another month leaves this one's slice whole or empty
            while len(found) <= limit and scanned < SCAN_LIMIT:
                batch = min(FILTER_BATCH if filtered else limit + 1 - len(found), SCAN_LIMIT - scanned)
                index = await self._index_page(org_id, month, cursor, ascending, batch=batch)
                if not index:
                    break
                wanted = [r for r in index if _may_match(r, model, metadata)][:limit + 1 - len(found)]
                # Past the last row read for the page, the batch's other rows are left for the next page.
                last = wanted[-1] if len(wanted) == limit + 1 - len(found) else index[-1]
                scanned += index.index(last) + 1
                cursor = (last["created_at"], last["completion_id"])
                rows = await self._get_many([r["completion_id"] for r in wanted], org_id)
                found += [r for r in rows if r is not None and _has(r, metadata)]
            if len(found) > limit:
                break
        # Past the scan limit the rest was not looked at: say so (the last item is the cursor to go on from).
        return Page(found[:limit], len(found) > limit or scanned >= SCAN_LIMIT)

    async def _get_many(self, completion_ids: list[str], org_id: str) -> list[dict[str, Any] | None]:
        semaphore = asyncio.Semaphore(GET_PARALLEL)

        async def one(completion_id: str) -> dict[str, Any] | None:
            async with semaphore:
                return await self.get(completion_id, org_id)

        return await asyncio.gather(*(one(c) for c in completion_ids))

    async def _index_page(self, org_id: str, month: str, cursor: tuple[datetime, str] | None, ascending: bool,
                          *, batch: int) -> list[dict[str, Any]]:
        if cursor is None:
            statement, params = (self._oldest if ascending else self._newest), [org_id, month, batch]
        else:
            statement = self._newer if ascending else self._older
            params = [org_id, month, cursor[0], cursor[1], batch]
        return await execute(self._session, statement, params)


def _may_match(index_row: dict[str, Any], model: str | None, metadata: dict[str, str]) -> bool:
    """Whether an index row passes the filter (an index row without metadata, written before it was indexed, may:
    its completion row says)."""
    if model is not None and index_row["model"] != model:
        return False
    if not metadata or index_row["metadata_json"] is None:
        return True
    return _has({"metadata": orjson.loads(index_row["metadata_json"])}, metadata)


def _has(row: dict[str, Any], metadata: dict[str, str]) -> bool:
    stored = row.get("metadata") or {}
    return all(stored.get(k) == v for k, v in metadata.items())
