"""The billing ledger in Cassandra: one row per request id, and everything derived from it.

Every write here is idempotent, so the billing processor can run at-least-once and replays are harmless:

* ``ledger_by_request`` is written with ``IF NOT EXISTS``: the first committed usage of a request id wins;
  later ones (a redelivery, a regenerated attempt, a replay) read the winner back instead of billing again.
* ``ledger_by_org_day`` / ``ledger_orgs_by_day`` are upserts of the winner (same values every time).
* ``dirty_hours`` marks the (org, hour) buckets to recompute; a mark is cleared with the write time it was read
  with, so a bucket marked again during its recomputation stays marked.
* ``usage_hourly`` is recomputed from the ledger and overwritten, never incremented.

A row records the price version that billed it: its label (``price_version``) and its key in the price table
(``price_valid_from``; null on rows written before it was recorded). Nothing here re-prices a billed row:
:meth:`Ledger.correct` (reconcile's repair) is conditional on the row's price version.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass, fields
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from typing import Any

from cassandra.cluster import Session
from cassandra.query import BatchStatement, BatchType

from billing.prices import PriceBook
from runtime.cassandra_client import execute, pages
from schemas.events import UsageEvent

DIRTY_SHARD = 0
#: hours still marked dirty that a usage report reads from the ledger instead of their aggregate (the newest ones);
#: more than this only while the billing processor is far behind, and the older ones then answer as last computed
DIRTY_HOURS_READ = 4
#: rows a usage report holds at once per query it pages through, and the day partitions it reads at once
PAGE_ROWS = 1000
PARALLEL_DAYS = 8


def utc(value: datetime) -> datetime:
    """The driver returns naive UTC datetimes; the platform uses aware ones."""
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def parse_instant(value: str) -> datetime:
    """An ISO 8601 time (naive means UTC) or Unix seconds. ValueError when it is neither."""
    try:
        if value.replace(".", "", 1).isdigit():
            return datetime.fromtimestamp(float(value), UTC)
        return utc(datetime.fromisoformat(value.replace("Z", "+00:00")))
    except (OverflowError, OSError) as exc:
        raise ValueError(str(exc)) from exc


def hour_of(at: datetime) -> datetime:
    return utc(at).replace(minute=0, second=0, microsecond=0)


def _ms(at: datetime) -> datetime:
    # Cassandra timestamps have millisecond precision: round once, so that every copy of a row compares equal.
    at = utc(at)
    return at.replace(microsecond=at.microsecond // 1000 * 1000)


@dataclass(frozen=True)
class LedgerRow:
    request_id: str
    org_id: str
    key_id: str
    tier: str
    model: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cost: Decimal
    price_version: str
    finish_reason: str
    attempt: int
    requested_at: datetime
    finished_at: datetime
    #: the billing version's key in the price table (with ``model``); None on rows billed before it was recorded
    price_valid_from: datetime | None = None

    @classmethod
    def from_usage(cls, usage: UsageEvent, prices: PriceBook) -> LedgerRow:
        """The row billing ``usage`` now: priced with the version valid at the request's time (raises UnknownPrice,
        or PriceBookStale when the book cannot vouch for that time)."""
        price = prices.price_at(usage.model, usage.requested_at)
        return cls(
            request_id=usage.request_id, org_id=usage.org_id, key_id=usage.key_id, tier=usage.tier,
            model=usage.model, prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
            cached_tokens=usage.cached_tokens,
            cost=price.cost(usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens),
            price_version=price.version, finish_reason=usage.finish_reason, attempt=usage.attempt,
            requested_at=_ms(usage.requested_at), finished_at=_ms(usage.finished_at),
            price_valid_from=_ms(price.valid_from),
        )

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> LedgerRow:
        values = {f.name: row[f.name] for f in fields(cls)}
        values["requested_at"] = utc(values["requested_at"])
        values["finished_at"] = utc(values["finished_at"])
        if values["price_valid_from"] is not None:
            values["price_valid_from"] = utc(values["price_valid_from"])
        return cls(**values)

    @property
    def day(self) -> date:
        return self.requested_at.date()

    @property
    def hour(self) -> datetime:
        return hour_of(self.requested_at)


_COLUMNS = [f.name for f in fields(LedgerRow)]
_CORRECTED = [c for c in _COLUMNS if c not in ("request_id", "price_version")]
_ORG_DAY_COLUMNS = ["org_id", "day", "requested_at", "request_id", "key_id", "model", "prompt_tokens",
                    "completion_tokens", "cached_tokens", "cost", "price_version", "finish_reason"]


@dataclass(frozen=True)
class Totals:
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    cost: Decimal = Decimal(0)

    def add(self, row: LedgerRow | dict[str, Any]) -> Totals:
        values: dict[str, Any] = row if isinstance(row, dict) else row.__dict__
        return Totals(self.requests + 1, self.prompt_tokens + values["prompt_tokens"],
                      self.completion_tokens + values["completion_tokens"],
                      self.cached_tokens + values["cached_tokens"], self.cost + values["cost"])

    def add_hour(self, row: dict[str, Any]) -> Totals:
        """An aggregate of ``usage_hourly`` (its ``requests`` and sums)."""
        return Totals(self.requests + row["requests"], self.prompt_tokens + row["prompt_tokens"],
                      self.completion_tokens + row["completion_tokens"],
                      self.cached_tokens + row["cached_tokens"], self.cost + row["cost"])

    def __add__(self, other: Totals) -> Totals:
        return Totals(self.requests + other.requests, self.prompt_tokens + other.prompt_tokens,
                      self.completion_tokens + other.completion_tokens, self.cached_tokens + other.cached_tokens,
                      self.cost + other.cost)


#: a usage report's group of a request: its label from the request's model and time (an hour's start for an aggregate)
Label = Callable[[str, datetime], str]


class Ledger:
    def __init__(self, session: Session, keyspace: str) -> None:
        self._session = session
        ks = keyspace
        prepare = session.prepare
        placeholders = ", ".join("?" for _ in _COLUMNS)
        self._insert_first = prepare(
            f"INSERT INTO {ks}.ledger_by_request ({', '.join(_COLUMNS)}) VALUES ({placeholders}) IF NOT EXISTS")
        self._correct = prepare(
            f"UPDATE {ks}.ledger_by_request SET {', '.join(f'{c} = ?' for c in _CORRECTED)} "
            "WHERE request_id = ? IF price_version = ?")
        self._get = prepare(f"SELECT {', '.join(_COLUMNS)} FROM {ks}.ledger_by_request WHERE request_id = ?")
        self._get_many = prepare(f"SELECT {', '.join(_COLUMNS)} FROM {ks}.ledger_by_request WHERE request_id IN ?")
        self._upsert_org_day = prepare(
            f"INSERT INTO {ks}.ledger_by_org_day ({', '.join(_ORG_DAY_COLUMNS)}) "
            f"VALUES ({', '.join('?' for _ in _ORG_DAY_COLUMNS)})")
        self._upsert_org_of_day = prepare(f"INSERT INTO {ks}.ledger_orgs_by_day (day, org_id) VALUES (?, ?)")
        self._mark_dirty = prepare(
            f"INSERT INTO {ks}.dirty_hours (shard, org_id, hour, marked) VALUES ({DIRTY_SHARD}, ?, ?, true)")
        self._dirty = prepare(
            f"SELECT org_id, hour, writetime(marked) AS marked_at FROM {ks}.dirty_hours WHERE shard = {DIRTY_SHARD}")
        self._clear_dirty = prepare(
            f"DELETE FROM {ks}.dirty_hours USING TIMESTAMP ? WHERE shard = {DIRTY_SHARD} AND org_id = ? AND hour = ?")
        self._rows_of_hour = prepare(
            f"SELECT key_id, model, prompt_tokens, completion_tokens, cached_tokens, cost "
            f"FROM {ks}.ledger_by_org_day WHERE org_id = ? AND day = ? AND requested_at >= ? AND requested_at < ?")
        self._rows_of_range = prepare(
            f"SELECT {', '.join(_ORG_DAY_COLUMNS)} FROM {ks}.ledger_by_org_day "
            "WHERE org_id = ? AND day = ? AND requested_at >= ? AND requested_at < ?")
        self._orgs_of_day = prepare(f"SELECT org_id FROM {ks}.ledger_orgs_by_day WHERE day = ?")
        self._clear_hour = prepare(
            f"DELETE FROM {ks}.usage_hourly USING TIMESTAMP ? WHERE org_id = ? AND day = ? AND hour = ?")
        self._write_hour = prepare(
            f"INSERT INTO {ks}.usage_hourly (org_id, day, hour, key_id, model, requests, prompt_tokens, "
            "completion_tokens, cached_tokens, cost) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) USING TIMESTAMP ?")
        self._hourly = prepare(
            f"SELECT hour, key_id, model, requests, prompt_tokens, completion_tokens, cached_tokens, cost "
            f"FROM {ks}.usage_hourly WHERE org_id = ? AND day = ?")
        self._hours_of_range = prepare(
            f"SELECT hour, model, requests, prompt_tokens, completion_tokens, cached_tokens, cost "
            f"FROM {ks}.usage_hourly WHERE org_id = ? AND day = ? AND hour >= ? AND hour < ?")
        self._usage_of_range = prepare(
            f"SELECT requested_at, model, prompt_tokens, completion_tokens, cached_tokens, cost "
            f"FROM {ks}.ledger_by_org_day WHERE org_id = ? AND day = ? AND requested_at >= ? AND requested_at < ?")
        self._dirty_of_org = prepare(
            f"SELECT hour FROM {ks}.dirty_hours WHERE shard = {DIRTY_SHARD} AND org_id = ? AND hour >= ? AND hour < ?")

    @classmethod
    async def open(cls, session: Session, keyspace: str) -> Ledger:
        return await asyncio.to_thread(cls, session, keyspace)

    # --- writes -----------------------------------------------------------------------------------------

    async def record(self, row: LedgerRow) -> tuple[LedgerRow, bool]:
        """Bill one request (idempotent). Returns the ledger's row for it and whether this call created it."""
        result = await execute(self._session, self._insert_first, [getattr(row, c) for c in _COLUMNS])
        applied = bool(result[0]["[applied]"])
        winner = row if applied else LedgerRow.from_row(result[0])
        await self.write_views(winner)
        return winner, applied

    async def correct(self, row: LedgerRow) -> bool:
        """Reconcile's repair of a billed row: make it (and its views) say ``row``, on condition that it is still
        billed with ``row.price_version`` — the version that billed a row is never changed here. Returns False
        (nothing written) when the row is gone or was billed with another version."""
        values = [getattr(row, c) for c in _CORRECTED] + [row.request_id, row.price_version]
        if not (await execute(self._session, self._correct, values))[0]["[applied]"]:
            return False
        await self.write_views(row)
        return True

    async def write_views(self, row: LedgerRow) -> None:
        """Upsert the by-org/day view and mark the hour dirty: ``row`` must be the ``ledger_by_request`` row."""
        batch = BatchStatement(batch_type=BatchType.LOGGED)
        batch.add(self._upsert_org_day, [row.org_id, row.day, row.requested_at, row.request_id, row.key_id,
                                         row.model, row.prompt_tokens, row.completion_tokens, row.cached_tokens,
                                         row.cost, row.price_version, row.finish_reason])
        batch.add(self._upsert_org_of_day, [row.day, row.org_id])
        batch.add(self._mark_dirty, [row.org_id, row.hour])
        await execute(self._session, batch)

    # --- aggregates ---------------------------------------------------------------------------------------

    async def recompute_hour(self, org_id: str, hour: datetime) -> int:
        """Rewrite one (org, hour)'s aggregates from the ledger. Returns the number of (key, model) groups."""
        hour = hour_of(hour)
        rows = await execute(self._session, self._rows_of_hour,
                             [org_id, hour.date(), hour, hour + timedelta(hours=1)])
        groups: dict[tuple[str, str], Totals] = defaultdict(Totals)
        for row in rows:
            groups[(row["key_id"], row["model"])] = groups[(row["key_id"], row["model"])].add(row)
        stamp = time.time_ns() // 1000
        # One partition, one batch: the old rows go (tombstone at t) and the new ones appear (at t + 1) together.
        batch = BatchStatement(batch_type=BatchType.LOGGED)
        batch.add(self._clear_hour, [stamp, org_id, hour.date(), hour])
        for (key_id, model), t in groups.items():
            batch.add(self._write_hour, [org_id, hour.date(), hour, key_id, model, t.requests, t.prompt_tokens,
                                         t.completion_tokens, t.cached_tokens, t.cost, stamp + 1])
        await execute(self._session, batch)
        return len(groups)

    async def flush_dirty(self) -> int:
        """Recompute every marked hour; a mark is cleared only if nobody marked it again meanwhile."""
        marks = await execute(self._session, self._dirty)
        for mark in marks:
            await self.recompute_hour(mark["org_id"], utc(mark["hour"]))
            await execute(self._session, self._clear_dirty, [mark["marked_at"], mark["org_id"], mark["hour"]])
        return len(marks)

    async def hourly(self, org_id: str, day: date) -> list[dict[str, Any]]:
        return await execute(self._session, self._hourly, [org_id, day])

    # --- reads --------------------------------------------------------------------------------------------

    async def usage(self, org_id: str, start: datetime, end: datetime, label: Label) -> dict[str, Totals]:
        """The org's usage with start <= requested_at < end, summed per ``label``: what summing its ledger rows
        gives, without holding them. Whole hours come from ``usage_hourly``; the hours the range cuts (its first
        and last: the current one when ``end`` is now) and the whole hours still marked dirty (billed since their
        last recomputation; the newest ``DIRTY_HOURS_READ``) are summed from the ledger, a page at a time.

        The dirty marks are read before the aggregates: an hour found clean was recomputed from every row marked
        before that read (a mark is cleared only after its hour's aggregates are written)."""
        groups: dict[str, Totals] = defaultdict(Totals)
        first_whole, past_whole = _ceil_hour(start), hour_of(end)
        from_ledger: list[tuple[datetime, datetime]] = []
        if first_whole < past_whole:
            from_ledger += [(a, b) for a, b in ((start, first_whole), (past_whole, end)) if a < b]
            dirty = await self._dirty_hours(org_id, first_whole, past_whole)
            stale = sorted(dirty, reverse=True)[:DIRTY_HOURS_READ]
            from_ledger += [(hour, hour + timedelta(hours=1)) for hour in stale]
            await self._sum_hours(org_id, first_whole, past_whole, set(stale), label, groups)
        else:  # no whole hour in the range
            from_ledger.append((start, end))
        for a, b in from_ledger:
            await self._sum_rows(org_id, a, b, label, groups)
        return dict(groups)

    async def _dirty_hours(self, org_id: str, start: datetime, end: datetime) -> list[datetime]:
        return [utc(row["hour"]) async for page in pages(self._session, self._dirty_of_org, [org_id, start, end],
                                                          page_size=PAGE_ROWS) for row in page]

    async def _sum_hours(self, org_id: str, start: datetime, end: datetime, skip: set[datetime], label: Label,
                         groups: dict[str, Totals]) -> None:
        async def day(params: list[Any]) -> None:
            async for page in pages(self._session, self._hours_of_range, params, page_size=PAGE_ROWS):
                for row in page:
                    hour = utc(row["hour"])
                    if hour not in skip:
                        name = label(row["model"], hour)
                        groups[name] = groups[name].add_hour(row)

        await _bounded([day([org_id, d, start, end]) for d in _days(start, end)])

    async def _sum_rows(self, org_id: str, start: datetime, end: datetime, label: Label,
                        groups: dict[str, Totals]) -> None:
        async def day(params: list[Any]) -> None:
            async for page in pages(self._session, self._usage_of_range, params, page_size=PAGE_ROWS):
                for row in page:
                    name = label(row["model"], utc(row["requested_at"]))
                    groups[name] = groups[name].add(row)

        await _bounded([day([org_id, d, start, end]) for d in _days(start, end)])

    async def get(self, request_id: str) -> LedgerRow | None:
        rows = await execute(self._session, self._get, [request_id])
        return LedgerRow.from_row(rows[0]) if rows else None

    async def rows_for_org(self, org_id: str, start: datetime, end: datetime) -> list[dict[str, Any]]:
        """The org's ledger rows with start <= requested_at < end (one query per day, concurrently)."""
        days = _days(start, end)
        results = await asyncio.gather(*(
            execute(self._session, self._rows_of_range, [org_id, day, start, end]) for day in days
        ))
        return [row for rows in results for row in rows]

    async def orgs_between(self, start: datetime, end: datetime) -> list[str]:
        results = await asyncio.gather(*(execute(self._session, self._orgs_of_day, [d]) for d in _days(start, end)))
        return sorted({row["org_id"] for rows in results for row in rows})

    async def rows_between(self, start: datetime, end: datetime) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        for org_id in await self.orgs_between(start, end):
            rows.extend(await self.rows_for_org(org_id, start, end))
        return rows

    async def full_rows(self, request_ids: Iterable[str], chunk: int = 100, parallel: int = 16
                        ) -> dict[str, LedgerRow]:
        """``ledger_by_request`` rows of many ids: IN queries of ``chunk`` ids, ``parallel`` at a time."""
        ids = list(request_ids)
        semaphore = asyncio.Semaphore(parallel)

        async def one(part: list[str]) -> list[dict[str, Any]]:
            async with semaphore:
                return await execute(self._session, self._get_many, [part])

        parts = await asyncio.gather(*(one(ids[i:i + chunk]) for i in range(0, len(ids), chunk)))
        return {row["request_id"]: LedgerRow.from_row(row) for rows in parts for row in rows}


async def _bounded(reads: list[Coroutine[Any, Any, None]]) -> None:
    """Run day reads, ``PARALLEL_DAYS`` at a time."""
    semaphore = asyncio.Semaphore(PARALLEL_DAYS)

    async def one(read: Coroutine[Any, Any, None]) -> None:
        async with semaphore:
            await read

    await asyncio.gather(*(one(read) for read in reads))


def _ceil_hour(at: datetime) -> datetime:
    hour = hour_of(at)
    return hour if hour == utc(at) else hour + timedelta(hours=1)


def _days(start: datetime, end: datetime) -> list[date]:
    first, last = utc(start).date(), (utc(end) - timedelta(microseconds=1)).date()
    return [first + timedelta(days=i) for i in range((last - first).days + 1)]

