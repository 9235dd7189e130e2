"""Adversarial review of monthly budgets: pure-logic defects (the Redis side is in
tests/integration/test_budget_review.py)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal

from billing.prices import Price, PriceLead, check_new_price
from runtime.spend import ledger_nanos, to_nanos

NOW = datetime(2026, 11, 22, 10, tzinfo=UTC)


def test_billed_adds_up_to_the_ledger_sum_at_any_price_the_table_accepts() -> None:
    """The price table accepts rates finer than a nano-dollar per token (e.g. $0.01875/M cached input: 18.75
    nano-dollars per token). The charge rounds each row; ``kns billing spend`` and the chaos audit once rounded the
    ledger's *sum*: four such rows gave billed 76 against a ledger of 75, reported as drift forever. The ledger's
    figure is now the sum of the rows as charged (``ledger_nanos``)."""
    price = Price("m", NOW + timedelta(days=1), "v1", Decimal("0.075"), Decimal("0.01875"), Decimal("0.30"))
    check_new_price([], price, now=NOW, lead=PriceLead(60))  # accepted
    costs = [price.cost(1, 0, 1) for _ in range(4)]  # one cached prompt token each
    charged = sum(to_nanos(c) for c in costs)  # what the billing processor's charges add up to
    assert ledger_nanos(costs) == charged == 76
