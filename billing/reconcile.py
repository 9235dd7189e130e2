"""Reconciliation: replay the usage topic, recompute what the ledger must say, diff it, optionally repair.

The replay is the source of truth for *usage* (the first committed usage per request id); the ledger row is the
source of truth for *which price version billed it*: a billed cost is final, and a price table that changed
afterwards never changes it. The ledger is checked row by row (``ledger_by_org_day`` for the range,
``ledger_by_request`` for every request id) and summarised per organisation and model.

What ``repair`` may write (each discrepancy carries its :class:`Repair`, or None when it is only reported):

* ``missing`` with no ``ledger_by_request`` row: the request was never billed; billing it now is its first
  billing, priced with the version valid at the request's time (insert if not exists: a processor that bills it
  meanwhile wins).
* ``mismatched`` ledger row (usage fields disagree with the committed usage, or the cost disagrees with the
  version the row records): the usage fields are restored and the cost recomputed **with the version the row was
  billed with** (conditional on that version). A row from before the ledger recorded the version's key is only
  repaired when its billed cost stays the same (its label alone cannot prove which rates billed it).
* ``missing`` / ``mismatched`` view only: ``ledger_by_org_day`` is rewritten from the (restored) ledger row.

Reported, never repaired: ``repriced`` (billed with a version that the price table no longer applies at the
request's time: billed costs are final, a correction is a credit, not a rewrite), ``unexpected`` (a ledger row
without committed usage), ``unpriced`` (no price for the usage now), and a ``mismatched`` row whose billing
version cannot be found.
"""

from __future__ import annotations

import asyncio
from collections import Counter, defaultdict
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Literal

from billing.ledger import Ledger, LedgerRow, Totals, utc
from billing.prices import Price, PriceBook, UnknownPrice
from billing.replay import UsageReplay
from runtime.spend import SpendBook

USAGE_FIELDS = ("org_id", "key_id", "tier", "model", "prompt_tokens", "completion_tokens", "cached_tokens",
                "finish_reason", "attempt", "requested_at", "finished_at")
COMPARED = ("org_id", "key_id", "model", "prompt_tokens", "completion_tokens", "cached_tokens", "cost",
            "finish_reason")
VIEW_COMPARED = (*COMPARED, "price_version")
#: what each repair action writes, as the CLI states it
ACTIONS = {
    "insert": "inserted (never billed: priced at the request's time)",
    "correct": "corrected (usage restored, cost at the version that billed the row)",
    "views": "views rewritten from their ledger row",
}
FINAL = "billed costs are final"


@dataclass(frozen=True)
class Repair:
    action: Literal["insert", "correct", "views"]
    row: LedgerRow


@dataclass
class Discrepancy:
    request_id: str
    kind: str  # missing | mismatched | repriced | unexpected | unpriced
    detail: str
    repair: Repair | None = None  # what --repair writes; None: reported only


@dataclass
class Report:
    expected: dict[tuple[str, str], Totals] = field(default_factory=dict)
    actual: dict[tuple[str, str], Totals] = field(default_factory=dict)
    discrepancies: list[Discrepancy] = field(default_factory=list)
    replayed: int = 0
    duplicates: int = 0
    repaired: int = 0
    repaired_by_action: dict[str, int] = field(default_factory=dict)
    #: repairs that found the row changed under them (billed with another version meanwhile): left alone
    skipped: list[Discrepancy] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not self.discrepancies

    @property
    def not_repairable(self) -> list[Discrepancy]:
        return [d for d in self.discrepancies if d.repair is None]


def expected_rows(replay: UsageReplay, prices: PriceBook) -> tuple[dict[str, LedgerRow], list[Discrepancy]]:
    """Each request as billing it now would write it (the price valid at the request's time)."""
    rows, unpriced = {}, []
    for request_id, usage in replay.first.items():
        try:
            rows[request_id] = LedgerRow.from_usage(usage, prices)
        except UnknownPrice as exc:
            unpriced.append(Discrepancy(request_id, "unpriced", str(exc)))
    return rows, unpriced


def billed_price(record: LedgerRow, prices: PriceBook) -> Price | None:
    """The version that billed a ledger row: by its key in the price table; for a row from before the key was
    recorded, by its label when exactly one version of the model has it."""
    if record.price_valid_from is not None:
        return prices.version(record.model, record.price_valid_from)
    return prices.labelled(record.model, record.price_version)


def _differences(want: LedgerRow, actual: dict[str, object], names: tuple[str, ...], where: str) -> list[str]:
    return [f"{where}{name}: ledger {actual[name]!r} ≠ usage {getattr(want, name)!r}"
            for name in names if name in actual and actual[name] != getattr(want, name)]


def restore(record: LedgerRow, usage: LedgerRow, price: Price) -> LedgerRow:
    """What a billed row must say: its usage fields from the committed usage, its cost those tokens at ``price``
    (the version that billed it), everything about its billing (version, request id) as it is."""
    row = replace(record, **{name: getattr(usage, name) for name in USAGE_FIELDS}, price_valid_from=price.valid_from)
    return replace(row, cost=price.cost(row.prompt_tokens, row.completion_tokens, row.cached_tokens))


def _check_billed(want_now: LedgerRow, record: LedgerRow, view: dict[str, object] | None,
                  prices: PriceBook) -> tuple[LedgerRow, list[Discrepancy]]:
    """A request with a ledger row: (what the row must say, what is wrong with it)."""
    rid, found = record.request_id, []
    price = billed_price(record, prices)
    if price is None:
        problems = _differences(want_now, record.__dict__, tuple(n for n in COMPARED if n != "cost"), "")
        if problems:
            found.append(Discrepancy(rid, "mismatched", "; ".join(problems) + f" — not repaired: its billing version "
                                     f"{record.price_version!r} is not in the price table (or not uniquely)"))
        return record, found
    target = restore(record, want_now, price)
    problems = _differences(target, record.__dict__, COMPARED, "")
    if problems and record.price_valid_from is None and target.cost != record.cost:
        found.append(Discrepancy(rid, "mismatched", "; ".join(problems) + " — not repaired: billed before the ledger "
                                 "recorded its version's key, and the repair would change its cost"))
        target = record
    elif problems:
        found.append(Discrepancy(rid, "mismatched", "; ".join(problems), Repair("correct", target)))
    elif view is None:
        found.append(Discrepancy(rid, "missing", "not in ledger_by_org_day", Repair("views", target)))
    elif view_problems := _differences(target, view, VIEW_COMPARED, "ledger_by_org_day "):
        found.append(Discrepancy(rid, "mismatched", "; ".join(view_problems), Repair("views", target)))
    if problems and view is None:
        found[-1].detail += "; not in ledger_by_org_day"
    if want_now.price_valid_from != price.valid_from:
        found.append(Discrepancy(rid, "repriced", f"billed with {price.describe()}; the price table now gives "
                                 f"{want_now.price_version!r} at {want_now.requested_at.isoformat()} — not repaired: "
                                 f"{FINAL}"))
    return target, found


def totals(rows: list[LedgerRow] | list[dict[str, object]]) -> dict[tuple[str, str], Totals]:
    out: dict[tuple[str, str], Totals] = defaultdict(Totals)
    for row in rows:
        org, model = (row["org_id"], row["model"]) if isinstance(row, dict) else (row.org_id, row.model)
        out[(str(org), str(model))] = out[(str(org), str(model))].add(row)
    return dict(out)


def compare(expected: dict[str, LedgerRow], by_day: list[dict[str, object]], by_request: dict[str, LedgerRow],
            prices: PriceBook, should: dict[str, LedgerRow] | None = None) -> list[Discrepancy]:
    """Diff the ledger against ``expected`` (each request as billing it now would write it). ``should`` receives
    what each request's ledger row must say (for a billed one: at the version that billed it)."""
    found: list[Discrepancy] = []
    should = {} if should is None else should
    day_rows = {str(r["request_id"]): r for r in by_day}
    for request_id, want_now in expected.items():
        view, record = day_rows.get(request_id), by_request.get(request_id)
        if record is None:
            where = "ledger_by_request" + (" and ledger_by_org_day" if view is None else "")
            found.append(Discrepancy(request_id, "missing", f"not in {where}", Repair("insert", want_now)))
            should[request_id] = want_now
            continue
        should[request_id], problems = _check_billed(want_now, record, view, prices)
        found.extend(problems)
    for request_id in day_rows.keys() - expected.keys():
        found.append(Discrepancy(request_id, "unexpected", "in the ledger, but no committed usage in the range"))
    return found


async def _apply(ledger: Ledger, spend: SpendBook | None, repair: Repair) -> bool:
    """Fix one row; what it bills is charged to its org's monthly spend too (budgets see what billing charges)."""
    row = repair.row
    if repair.action == "insert":
        winner, _ = await ledger.record(row)  # if not exists: a processor that billed it meanwhile wins
        if spend is not None:
            await spend.charge(winner.request_id, winner.org_id, winner.requested_at, winner.cost)
        return True
    if repair.action == "correct":
        if not await ledger.correct(row):
            return False
        if spend is not None:  # the row's cost changed: the spend takes the difference
            await spend.charge(row.request_id, row.org_id, row.requested_at, row.cost, correction=True)
        return True
    await ledger.write_views(row)
    return True


async def reconcile(ledger: Ledger, prices: PriceBook, replay: UsageReplay, start: datetime, end: datetime, *,
                    repair: bool, org_id: str | None = None, spend: SpendBook | None = None) -> Report:
    """Diff (and with ``repair`` fix what may be fixed, see the module docstring) the ledger for the range;
    ``org_id`` limits both sides to one org. A repair charges what it bills to ``spend`` (required with it)."""
    if repair and spend is None:
        raise ValueError("a repair bills rows: it needs the spend book to charge them to")
    if org_id is not None:
        replay = replay.only_org(org_id)
    expected, unpriced = expected_rows(replay, prices)
    ledger_rows = await (ledger.rows_for_org(org_id, start, end) if org_id else ledger.rows_between(start, end))
    by_day = [r for r in ledger_rows if start <= utc(r["requested_at"]) < end]
    by_request = await ledger.full_rows(expected.keys())
    should: dict[str, LedgerRow] = {}
    discrepancies = compare(expected, by_day, by_request, prices, should)
    report = Report(expected=totals(list(should.values())), actual=totals(by_day), replayed=len(replay.records),
                    duplicates=replay.duplicates, discrepancies=unpriced + discrepancies)
    if repair:
        fixable = [d for d in report.discrepancies if d.repair is not None]
        semaphore = asyncio.Semaphore(64)

        async def fix(found: Discrepancy) -> bool:
            assert found.repair is not None
            async with semaphore:
                return await _apply(ledger, spend, found.repair)

        done = await asyncio.gather(*(fix(d) for d in fixable))
        await ledger.flush_dirty()
        applied = [d for d, ok in zip(fixable, done, strict=True) if ok]
        report.skipped = [d for d, ok in zip(fixable, done, strict=True) if not ok]
        report.repaired = len(applied)
        report.repaired_by_action = dict(Counter(d.repair.action for d in applied if d.repair is not None))
    return report
