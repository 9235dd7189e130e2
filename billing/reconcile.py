"""Reconciliation: replay the usage topic, recompute what the ledger must say, diff it, optionally repair.

The replay is the source of truth (the first committed usage per request id, priced with the price valid at the
request's time); the ledger is checked row by row (``ledger_by_org_day`` for the range, ``ledger_by_request`` for
every request id) and summarised per organisation and model. Repair re-applies the expected rows (idempotent),
then recomputes the affected hourly aggregates.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime

from billing.ledger import Ledger, LedgerRow, Totals, utc
from billing.prices import PriceBook, UnknownPrice
from billing.replay import UsageReplay

COMPARED = ("org_id", "key_id", "model", "prompt_tokens", "completion_tokens", "cached_tokens", "cost",
            "finish_reason")


@dataclass
class Discrepancy:
    request_id: str
    kind: str  # missing | mismatched | unexpected | unpriced
    detail: str


@dataclass
class Report:
    expected: dict[tuple[str, str], Totals] = field(default_factory=dict)
    actual: dict[tuple[str, str], Totals] = field(default_factory=dict)
    discrepancies: list[Discrepancy] = field(default_factory=list)
    replayed: int = 0
    duplicates: int = 0
    repaired: int = 0

    @property
    def clean(self) -> bool:
        return not self.discrepancies


def expected_rows(replay: UsageReplay, prices: PriceBook) -> tuple[dict[str, LedgerRow], list[Discrepancy]]:
    rows, unpriced = {}, []
    for request_id, usage in replay.first.items():
        try:
            rows[request_id] = LedgerRow.from_usage(usage, prices)
        except UnknownPrice as exc:
            unpriced.append(Discrepancy(request_id, "unpriced", str(exc)))
    return rows, unpriced


def _view_row(row: dict[str, object]) -> dict[str, object]:
    return {name: row[name] for name in COMPARED if name in row}


def _differences(expected: LedgerRow, actual: dict[str, object]) -> list[str]:
    return [f"{name}: ledger {actual[name]!r} ≠ usage {getattr(expected, name)!r}"
            for name in COMPARED if name in actual and actual[name] != getattr(expected, name)]


def totals(rows: list[LedgerRow] | list[dict[str, object]]) -> dict[tuple[str, str], Totals]:
    out: dict[tuple[str, str], Totals] = defaultdict(Totals)
    for row in rows:
        org, model = (row["org_id"], row["model"]) if isinstance(row, dict) else (row.org_id, row.model)
        out[(str(org), str(model))] = out[(str(org), str(model))].add(row)
    return dict(out)


def compare(expected: dict[str, LedgerRow], by_day: list[dict[str, object]],
            by_request: dict[str, LedgerRow]) -> list[Discrepancy]:
    found: list[Discrepancy] = []
    day_rows = {str(r["request_id"]): r for r in by_day}
    for request_id, want in expected.items():
        view, record = day_rows.get(request_id), by_request.get(request_id)
        if view is None or record is None:
            places = (("ledger_by_org_day", view), ("ledger_by_request", record))
            where = " and ".join(name for name, found_row in places if found_row is None)
            found.append(Discrepancy(request_id, "missing", f"not in {where}"))
            continue
        problems = _differences(want, view) + _differences(want, _view_row(record.__dict__))
        if problems:
            found.append(Discrepancy(request_id, "mismatched", "; ".join(sorted(set(problems)))))
    for request_id in day_rows.keys() - expected.keys():
        found.append(Discrepancy(request_id, "unexpected", "in the ledger, but no committed usage in the range"))
    return found


async def reconcile(ledger: Ledger, prices: PriceBook, replay: UsageReplay, start: datetime, end: datetime, *,
                    repair: bool, org_id: str | None = None) -> Report:
    """Diff (and with ``repair`` fix) the ledger for the range; ``org_id`` limits both sides to one org."""
    if org_id is not None:
        replay = replay.only_org(org_id)
    expected, unpriced = expected_rows(replay, prices)
    ledger_rows = await (ledger.rows_for_org(org_id, start, end) if org_id else ledger.rows_between(start, end))
    by_day = [r for r in ledger_rows if start <= utc(r["requested_at"]) < end]
    by_request = await ledger.full_rows(expected.keys())
    report = Report(expected=totals(list(expected.values())), actual=totals(by_day), replayed=len(replay.records),
                    duplicates=replay.duplicates)
    report.discrepancies = unpriced + compare(expected, by_day, by_request)
    if repair:
        fixable = [d for d in report.discrepancies if d.kind in ("missing", "mismatched")]
        semaphore = asyncio.Semaphore(64)

        async def fix(found: Discrepancy) -> None:
            async with semaphore:
                absent = found.kind == "missing" and found.request_id not in by_request
                await ledger.overwrite(expected[found.request_id], missing=absent)

        await asyncio.gather(*(fix(d) for d in fixable))
        await ledger.flush_dirty()
        report.repaired = len(fixable)
    return report
