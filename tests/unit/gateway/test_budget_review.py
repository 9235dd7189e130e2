"""Adversarial review of monthly budgets: pure-logic defects (the Redis side is in
tests/integration/test_budget_review.py)."""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from fractions import Fraction

import pytest

from billing.prices import Price, PriceLead, check_new_price
from runtime.settings import RedisSettings
from runtime.spend import SpendBook, ledger_nanos

NOW = datetime(2026, 11, 22, 10, tzinfo=UTC)


class ChargeScript:
    """A Redis whose scripts only record their arguments: what ``SpendBook.charge`` sends to bill a row."""

    def __init__(self) -> None:
        self.nanos: list[int] = []

    def register_script(self, _source: str) -> Callable[..., Awaitable[list[object]]]:
        async def run(*, keys: list[str], args: list[object], client: object = None) -> list[object]:
            self.nanos.append(int(args[1]))  # type: ignore[call-overload]
            return [1, sum(self.nanos), -1, 1, -1, -1]
        return run


def _nanos_half_up(usd_per_mtok: str, tokens: int) -> int:
    """A row's cost in nano-dollars, rounded half up, from the rate as written (exact fractions, not Decimal)."""
    return math.floor(Fraction(usd_per_mtok) * tokens * 1000 + Fraction(1, 2))


@pytest.mark.parametrize(("cached_rate", "per_row"), [("0.01875", 19), ("0.0125", 13), ("0.3333", 333),
                                                      ("0.0000004", 0)])
async def test_billed_adds_up_to_the_ledger_sum_at_any_price_the_table_accepts(cached_rate: str,
                                                                               per_row: int) -> None:
    """The price table accepts rates finer than a nano-dollar per token (e.g. $0.01875/M cached input: 18.75
    nano-dollars per token). The charge rounds each row; ``kns billing spend`` and the chaos audit once rounded the
    ledger's *sum*: four such rows gave billed 76 against a ledger of 75, reported as drift forever. The ledger's
    figure is now the sum of the rows as charged (``ledger_nanos``). Billed here is what the billing processor's
    charge sends to Redis, row by row; both sides are checked against the rate as written, rounded by hand."""
    price = Price("m", NOW + timedelta(days=1), "v1", Decimal("0.075"), Decimal(cached_rate), Decimal("0.30"))
    check_new_price([], price, now=NOW, lead=PriceLead(60))  # accepted
    costs = [price.cost(1, 0, 1) for _ in range(4)]  # one cached prompt token each
    redis = ChargeScript()
    book = SpendBook(redis, RedisSettings())  # type: ignore[arg-type]
    for i, cost in enumerate(costs):
        await book.charge(f"r{i}", "org", NOW, cost)
    assert per_row == _nanos_half_up(cached_rate, 1)
    assert redis.nanos == [per_row] * 4
    assert ledger_nanos(costs) == sum(redis.nanos) == 4 * per_row


