"""Versioned prices: USD per million tokens, per model, each valid from a point in time.

The seed lives in ``billing/prices.v*.json`` (the newest file is loaded into Cassandra by provisioning); new
prices are added as new rows (``kns billing set-price``), never edited, so any past request can be re-priced
exactly. Costs are ``Decimal``: no float ever touches money.

Three rules keep a billed cost final:

* **A version is never edited.** ``(model, valid_from)`` is the table's key and every write is ``INSERT ... IF NOT
  EXISTS`` (a Paxos round), so of two operators adding the same version at once exactly one wins; the other, like
  anyone re-adding an existing version with other rates, gets :class:`PriceExists`. The seed is idempotent: a seed
  row already stored identically is a no-op, a different one is refused.
* **A new version starts far enough ahead** (:class:`PriceLead`): every billing processor reloads the table every
  ``processors.price_reload_s``; a version must start at least two reload intervals plus :data:`SETTLE_MARGIN`
  after it is added, so each processor has loaded it (even one that missed a reload) before any request it
  applies to. The only exception is a stretch of time the model had no price at all (its first version, or one
  before its first): nothing was billed there, its usage was dead-lettered as unpriced.
* **A book never prices a time it cannot vouch for.** A book loaded at ``t`` holds every version that starts
  before ``t + lead.reach`` (any later addition starts after that, by the rule above); a request at or after that
  is refused with :class:`PriceBookStale`, and a billing processor reloads first (:class:`LivePrices`).

This module must not write ledger rows or decide what a repair may change (``billing/reconcile.py`` does).
"""

from __future__ import annotations

import bisect
import json
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any, Protocol

from cassandra import ConsistencyLevel
from cassandra.cluster import Session

from runtime.cassandra_client import execute
from runtime.retry import retry_transient

MTOK = Decimal(1_000_000)
PRICE_FILES = sorted(Path(__file__).parent.glob("prices.v*.json"), key=lambda p: int(p.stem.split(".v")[1]))
RATES = ("input_per_mtok", "cached_input_per_mtok", "output_per_mtok")
#: clock skew between the operator's machine and the processors, plus how long a price insert may be in flight;
#: part of every lead, taken off every book's reach
SETTLE_MARGIN = timedelta(seconds=60)

log = logging.getLogger(__name__)
Clock = Callable[[], datetime]


def utc_now() -> datetime:
    return datetime.now(UTC)


def _ms(at: datetime) -> datetime:
    # Cassandra timestamps have millisecond precision: a version is kept at it, so a stored one compares equal.
    at = at.replace(tzinfo=UTC) if at.tzinfo is None else at.astimezone(UTC)
    return at.replace(microsecond=at.microsecond // 1000 * 1000)


@dataclass(frozen=True)
class Price:
    model: str
    valid_from: datetime
    version: str
    input_per_mtok: Decimal
    cached_input_per_mtok: Decimal
    output_per_mtok: Decimal

    def __post_init__(self) -> None:
        object.__setattr__(self, "valid_from", _ms(self.valid_from))

    def cost(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Decimal:
        """Cached prompt tokens are part of prompt_tokens (OpenAI's convention) and billed at the cached rate."""
        uncached = max(0, prompt_tokens - cached_tokens)
        return (
            uncached * self.input_per_mtok
            + cached_tokens * self.cached_input_per_mtok
            + completion_tokens * self.output_per_mtok
        ) / MTOK

    def describe(self) -> str:
        return f"{self.model!r} {self.version!r} (valid from {self.valid_from.isoformat()})"


class UnknownPrice(LookupError):
    """No price can be given for this model at this time: not billable now (dead-lettered, repaired later)."""


class PriceBookStale(UnknownPrice):
    """The book was loaded too long ago to vouch for this time: a version added since may apply. Reload."""


class PriceRefused(ValueError):
    """A new price version breaks a rule of the price table; the message says which, in one line."""


class PriceExists(PriceRefused):
    """The model already has a version valid from that instant, and versions are never edited."""


def _span(delta: timedelta) -> str:
    seconds = delta.total_seconds()
    if seconds >= 120 and seconds % 60 == 0:
        return f"{seconds / 60:g} min"
    return f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.3g} s"


@dataclass(frozen=True)
class PriceLead:
    """How far ahead of now a new price must start, derived from how often billing processors reload the table.

    Why a book can trust its reach: a version added at time A starts at or after ``A + minimum``; a book whose
    read began at L can miss it only if it was added after ``L - margin`` (an insert still in flight, a skewed
    clock), so it starts after ``L + reach``, beyond what the book vouches for. The CLI and the processors must
    therefore use the same ``processors.price_reload_s``."""

    reload_s: float
    margin: timedelta = SETTLE_MARGIN

    @property
    def reach(self) -> timedelta:
        """How long after its load a book still holds every version that can apply: two reload intervals, so a
        processor that missed one reload (Cassandra down, a late timer) still bills from the book it has."""
        return 2 * timedelta(seconds=self.reload_s)

    @property
    def minimum(self) -> timedelta:
        """The minimum lead of a new version: the reach plus the margin (clock skew, an insert still in flight)."""
        return self.reach + self.margin

    def explain(self) -> str:
        return (f"{_span(self.minimum)} ahead (twice the price reload interval, processors.price_reload_s = "
                f"{_span(timedelta(seconds=self.reload_s))}, plus {_span(self.margin)} for clock skew), so every "
                "billing processor has loaded it before it applies")


def check_new_price(stored: Iterable[Price], new: Price, *, now: datetime, lead: PriceLead) -> None:
    """Raise :class:`PriceRefused` (one line: what is wrong and what is allowed) unless ``new`` may be added to a
    table holding ``stored``. Pure: the store calls it before its conditional insert."""
    for name in RATES:
        value: Decimal = getattr(new, name)
        if not value.is_finite() or value < 0:
            raise PriceRefused(f"{name} must be a non-negative decimal, not {value}")
    if not new.model or not new.version:
        raise PriceRefused("a price needs a model and a version label")
    versions = [p for p in stored if p.model == new.model]
    for old in versions:
        if old.valid_from == new.valid_from:
            raise PriceExists(f"{old.describe()} already exists; price versions are never edited: add a new version "
                              "with a later valid_from")
        if old.version == new.version:
            raise PriceRefused(f"version label {new.version!r} is already used by {old.describe()}: ledger rows name "
                               "the version that billed them, so a label is used once per model")
    if not versions or new.valid_from < min(p.valid_from for p in versions):
        return  # prices a stretch that had no price: nothing was billed there
    earliest = now + lead.minimum
    if new.valid_from < earliest:
        when = "is in the past" if new.valid_from <= now else f"is only {_span(new.valid_from - now)} from now"
        raise PriceRefused(f"valid_from {new.valid_from.isoformat()} {when}: a new price must start at least "
                           f"{lead.explain()}; the earliest allowed now is {_ms(earliest).isoformat()}")


class PriceBook:
    """All price versions, per model, ordered by validity; complete only up to ``complete_until`` when it was
    loaded from the live table (``None``: a fixed list, e.g. the seed file, complete for all time)."""

    def __init__(self, prices: Iterable[Price], *, complete_until: datetime | None = None) -> None:
        self.complete_until = complete_until
        self._by_model: dict[str, list[Price]] = {}
        for price in sorted(prices, key=lambda p: p.valid_from):
            self._by_model.setdefault(price.model, []).append(price)

    def covers(self, at: datetime) -> bool:
        return self.complete_until is None or at < self.complete_until

    def price_at(self, model: str, at: datetime, *, vouch: bool = True) -> Price:
        """The version valid at ``at``. ``vouch=False``: the newest the book knows of, even for a time it cannot
        vouch for (an estimate, e.g. a budget hold; never a bill)."""
        if vouch and self.complete_until is not None and at >= self.complete_until:
            raise PriceBookStale(f"the price book holds every version starting before "
                                 f"{self.complete_until.isoformat()}, so it cannot price {model!r} at {at.isoformat()} "
                                 "(a version added since may apply): reload it, or wait until that time is covered")
        versions = self._by_model.get(model)
        if not versions:
            raise UnknownPrice(f"no price for model {model!r}")
        index = bisect.bisect_right([p.valid_from for p in versions], at) - 1
        if index < 0:
            raise UnknownPrice(f"no price for {model!r} valid at {at.isoformat()}")
        return versions[index]

    def version(self, model: str, valid_from: datetime) -> Price | None:
        """The version with this key, if the book has it."""
        return next((p for p in self._by_model.get(model, []) if p.valid_from == _ms(valid_from)), None)

    def labelled(self, model: str, label: str) -> Price | None:
        """The one version of ``model`` with this label (None when none or, from before labels were unique, several)."""
        found = [p for p in self._by_model.get(model, []) if p.version == label]
        return found[0] if len(found) == 1 else None

    def all(self) -> list[Price]:
        return [p for versions in self._by_model.values() for p in versions]


def load_seed(path: Path | None = None) -> list[Price]:
    data = json.loads((path or PRICE_FILES[-1]).read_text())
    return [
        Price(
            model=row["model"],
            valid_from=datetime.fromisoformat(row["valid_from"].replace("Z", "+00:00")),
            version=row["version"],
            input_per_mtok=Decimal(row["input_per_mtok"]),
            cached_input_per_mtok=Decimal(row["cached_input_per_mtok"]),
            output_per_mtok=Decimal(row["output_per_mtok"]),
        )
        for row in data["prices"]
    ]


class PriceSource(Protocol):
    async def load(self) -> PriceBook: ...


class PriceStore:
    """The price table in Cassandra (``prices``): seeded from the newest ``prices.v*.json``, appended to after.

    Versions are written with a lightweight transaction and read at QUORUM, so a processor's reload sees every
    version whose insert has returned."""

    def __init__(self, session: Session, keyspace: str, lead: PriceLead, *, clock: Clock = utc_now) -> None:
        self._session = session
        self._lead = lead
        self._clock = clock
        columns = ", ".join(f.name for f in fields(Price))
        self._select = session.prepare(f"SELECT {columns} FROM {keyspace}.prices")
        self._select.consistency_level = ConsistencyLevel.QUORUM
        self._insert = session.prepare(
            f"INSERT INTO {keyspace}.prices ({columns}) VALUES (?, ?, ?, ?, ?, ?) IF NOT EXISTS")
        self._insert.consistency_level = ConsistencyLevel.QUORUM

    @property
    def lead(self) -> PriceLead:
        return self._lead

    @staticmethod
    def _price(row: dict[str, Any]) -> Price:
        return Price(row["model"], row["valid_from"], row["version"], row["input_per_mtok"],
                     row["cached_input_per_mtok"], row["output_per_mtok"])

    def _book(self, rows: list[dict[str, Any]], loaded_at: datetime) -> PriceBook:
        return PriceBook([self._price(r) for r in rows], complete_until=loaded_at + self._lead.reach)

    def load_sync(self) -> PriceBook:
        loaded_at = self._clock()  # before the read: what is added during it starts after the book's reach
        return self._book(list(self._session.execute(self._select)), loaded_at)

    async def load(self) -> PriceBook:
        loaded_at = self._clock()
        return self._book(await execute(self._session, self._select), loaded_at)

    async def add(self, price: Price) -> None:
        """Add a new version; :class:`PriceRefused` (or :class:`PriceExists`) when a rule forbids it."""
        stored = (await self.load()).all()
        check_new_price(stored, price, now=self._clock(), lead=self._lead)
        existing = await self._insert_new(price)
        if existing is not None:  # someone added this version between our read and our insert
            raise PriceExists(f"{existing.describe()} already exists; price versions are never edited: add a new "
                              "version with a later valid_from")

    async def seed(self, prices: list[Price]) -> None:
        """Idempotent: a seed version already stored identically is left alone, a different one is refused (never
        edited), a new one follows :func:`check_new_price` against the table as it was before seeding."""
        before = (await self.load()).all()
        for price in prices:
            stored = next((p for p in before if (p.model, p.valid_from) == (price.model, price.valid_from)), None)
            if stored is None:
                check_new_price(before, price, now=self._clock(), lead=self._lead)
                stored = await self._insert_new(price)
            if stored is not None and stored != price:
                raise PriceExists(f"the seed's {price.describe()} differs from the stored version; price versions "
                                  "are never edited: add a new version with a later valid_from")

    async def _insert_new(self, price: Price) -> Price | None:
        """The conditional insert; None when it was applied, else the version that was there."""
        result = await execute(self._session, self._insert, [getattr(price, f.name) for f in fields(Price)])
        return None if result[0]["[applied]"] else self._price(result[0])


class LivePrices:
    """The price book a billing processor prices with.

    A timer calls :meth:`reload` every reload interval; :meth:`book_for` reloads first when the book cannot vouch
    for a request's time (the timer's reloads failed, Cassandra down, or ran late) and waits out a Cassandra outage
    rather than price with an old book. A time even a fresh book cannot vouch for (a request stamped in the
    future) stays refused by the book: :class:`PriceBookStale`."""

    def __init__(self, source: PriceSource, book: PriceBook) -> None:
        self._source = source
        self.book = book

    async def reload(self) -> PriceBook:
        book = await self._source.load()
        # A slow reload that finishes after a newer one must not replace it.
        if self.book.complete_until is None or (book.complete_until is not None
                                                and book.complete_until >= self.book.complete_until):
            self.book = book
        return self.book

    async def book_for(self, at: datetime) -> PriceBook:
        if not self.book.covers(at):
            log.info("price book too old for a request; reloading",
                     extra={"requested_at": at.isoformat(), "complete_until": str(self.book.complete_until)})
            await retry_transient(self.reload, what="price reload")
        return self.book
