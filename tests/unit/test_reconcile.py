"""Reconcile's diff: missing, mismatched and unexpected rows; per org/model totals."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime
from decimal import Decimal

from billing.ledger import LedgerRow
from billing.reconcile import compare, totals

NOW = datetime(2026, 11, 22, 10, tzinfo=UTC)


def row(rid: str, org: str = "o", completion: int = 5) -> LedgerRow:
    return LedgerRow(rid, org, "k", "pro", "m", 10, completion, 0, Decimal("0.000002"), "v1", "stop", 1, NOW, NOW)


def view(r: LedgerRow) -> dict[str, object]:
    return {**r.__dict__, "day": r.day}


def test_a_matching_ledger_has_no_discrepancies() -> None:
    expected = {r.request_id: r for r in (row("a"), row("b"))}
    assert compare(expected, [view(r) for r in expected.values()], dict(expected)) == []


def test_each_kind_of_discrepancy_is_found() -> None:
    expected = {r.request_id: r for r in (row("a"), row("b"), row("c"))}
    corrupted = replace(expected["b"], completion_tokens=999)
    by_day = [view(expected["a"]), view(corrupted), view(row("zzz"))]  # c is missing, zzz was never used
    by_request = {"a": expected["a"], "b": corrupted, "zzz": row("zzz")}
    found = {(d.request_id, d.kind) for d in compare(expected, by_day, by_request)}
    assert found == {("b", "mismatched"), ("c", "missing"), ("zzz", "unexpected")}


def test_totals_per_org_and_model() -> None:
    result = totals([row("a", "o1"), row("b", "o1", completion=7), row("c", "o2")])
    assert result[("o1", "m")].requests == 2 and result[("o1", "m")].completion_tokens == 12
    assert result[("o2", "m")].cost == Decimal("0.000002")
