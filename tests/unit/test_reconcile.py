"""Reconcile's diff: missing, mismatched, repriced and unexpected rows; what repair may write; per org/model totals."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime
from decimal import Decimal

from billing.ledger import LedgerRow
from billing.prices import Price, PriceBook
from billing.reconcile import compare, totals

NOW = datetime(2026, 11, 22, 10, tzinfo=UTC)
V1 = Price("m", datetime(2026, 1, 1, tzinfo=UTC), "v1", Decimal("0.1"), Decimal("0.05"), Decimal("0.2"))
# Added after the rows below were billed, valid from before them: what `set-price` used to accept.
V1B = Price("m", datetime(2026, 11, 1, tzinfo=UTC), "v1b", Decimal("1"), Decimal("0.5"), Decimal("2"))
PRICES = PriceBook([V1])


def row(rid: str, org: str = "o", completion: int = 5, price: Price = V1) -> LedgerRow:
    return LedgerRow(rid, org, "k", "pro", "m", 10, completion, 0, price.cost(10, completion, 0), price.version,
                     "stop", 1, NOW, NOW, price.valid_from)


def view(r: LedgerRow) -> dict[str, object]:
    return {**r.__dict__, "day": r.day}


def test_a_matching_ledger_has_no_discrepancies() -> None:
    expected = {r.request_id: r for r in (row("a"), row("b"))}
    assert compare(expected, [view(r) for r in expected.values()], dict(expected), PRICES) == []


def test_each_kind_of_discrepancy_is_found() -> None:
    expected = {r.request_id: r for r in (row("a"), row("b"), row("c"))}
    corrupted = replace(expected["b"], completion_tokens=999)
    by_day = [view(expected["a"]), view(corrupted), view(row("zzz"))]  # c is missing, zzz was never used
    by_request = {"a": expected["a"], "b": corrupted, "zzz": row("zzz")}
    found = {(d.request_id, d.kind) for d in compare(expected, by_day, by_request, PRICES)}
    assert found == {("b", "mismatched"), ("c", "missing"), ("zzz", "unexpected")}


def test_a_missing_row_is_billed_at_the_price_valid_at_the_request_time() -> None:
    (found,) = compare({"c": row("c")}, [], {}, PRICES)
    assert found.kind == "missing" and found.repair is not None
    assert found.repair.action == "insert" and found.repair.row == row("c")


def test_a_row_billed_before_the_price_table_changed_is_reported_never_repriced() -> None:
    changed = PriceBook([V1, V1B])
    billed = row("a")
    expected = {"a": row("a", price=V1B)}  # what billing it now would say
    (found,) = compare(expected, [view(billed)], {"a": billed}, changed)
    assert found.kind == "repriced" and found.repair is None
    assert "v1" in found.detail and "v1b" in found.detail


def test_wrong_token_counts_are_restored_at_the_price_version_the_row_was_billed_with() -> None:
    changed = PriceBook([V1, V1B])
    billed = row("b")
    corrupted = replace(billed, completion_tokens=999)
    found = {d.kind: d for d in compare({"b": row("b", price=V1B)}, [view(corrupted)], {"b": corrupted}, changed)}
    assert set(found) == {"mismatched", "repriced"}
    repair = found["mismatched"].repair
    assert repair is not None and repair.action == "correct"
    assert repair.row == billed  # 5 completion tokens again, cost at v1 (its version), not at v1b
    assert found["repriced"].repair is None


def test_a_view_that_disagrees_with_its_ledger_row_is_rewritten_from_the_row() -> None:
    billed = row("a")
    (found,) = compare({"a": billed}, [view(replace(billed, cost=Decimal(7)))], {"a": billed}, PRICES)
    assert found.kind == "mismatched" and found.repair is not None
    assert (found.repair.action, found.repair.row) == ("views", billed)


def test_a_legacy_row_is_never_given_a_new_cost() -> None:
    # Written before the ledger recorded its price's valid_from: its version label is all it has, and labels
    # could be edited in place back then, so repair restores usage only where the billed cost stays.
    legacy = replace(row("a"), price_valid_from=None)
    tokens_only = replace(legacy, prompt_tokens=99)  # the cost is still the one of the committed usage
    (fixable,) = compare({"a": row("a")}, [view(tokens_only)], {"a": tokens_only}, PRICES)
    assert fixable.repair is not None and fixable.repair.row == row("a")
    cost_too = replace(legacy, completion_tokens=999, cost=V1.cost(10, 999, 0))
    (reported,) = compare({"a": row("a")}, [view(cost_too)], {"a": cost_too}, PRICES)
    assert reported.kind == "mismatched" and reported.repair is None and "not repaired" in reported.detail


def test_totals_per_org_and_model() -> None:
    result = totals([row("a", "o1"), row("b", "o1", completion=7), row("c", "o2")])
    assert result[("o1", "m")].requests == 2 and result[("o1", "m")].completion_tokens == 12
    assert result[("o2", "m")].cost == V1.cost(10, 5, 0)
