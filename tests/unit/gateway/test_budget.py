"""Budget holds and the 429 ``insufficient_quota`` (pure logic; the spend arithmetic runs on the real Redis in
tests/integration/test_budget_spend.py)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest

from billing.prices import LivePrices, Price, PriceBook
from producers.gateway.admission import Admission
from producers.gateway.budget import HoldPricer
from producers.gateway.errors import ApiError
from producers.gateway.local_limiter import LocalLimiter
from runtime.limiter import Decision, Refused, Window
from runtime.settings import TierTable
from runtime.spend import BudgetHold, Charged
from tests.fakes.tenancy import api_key

NOW = datetime(2026, 11, 30, 23, 59, 59, tzinfo=UTC)
PRICE = Price("m", NOW - timedelta(days=30), "v1", Decimal("0.30"), Decimal("0.15"), Decimal("1.20"))


class NoPrices:
    async def load(self) -> PriceBook:
        return PriceBook([PRICE])


def _pricer() -> HoldPricer:
    # loaded a while ago: the book no longer vouches for NOW, and a hold is priced all the same
    return HoldPricer(LivePrices(NoPrices(), PriceBook([PRICE], complete_until=NOW - timedelta(hours=1))), 60)


def test_a_hold_is_the_prompt_at_the_input_rate_plus_max_tokens_of_output() -> None:
    key = api_key()
    org = key.org.model_copy(update={"monthly_budget_micros": 5_000_000, "budget_alert_fraction": 0.9})
    hold = _pricer().hold(org, "m", 1000, 500, NOW)
    # 1000 x $0.30/M + 500 x $1.20/M = $0.0009 = 900,000 nano-dollars, in the month of the request's creation (UTC);
    # the $5 budget in the same unit
    assert hold == BudgetHold("2026-11", 5_000_000_000, 900_000, 0.9)
    # no budget: a hold of nothing, which tells admission the org has no budget (any more)
    assert _pricer().hold(key.org, "m", 1000, 500, NOW) == BudgetHold("2026-11", None, 0, 0.8)
    assert _pricer().hold(org, "unpriced", 1000, 500, NOW) == BudgetHold("2026-11", 5_000_000_000, 0, 0.9)


class SpentLimiter(LocalLimiter):
    def __init__(self) -> None:
        super().__init__()
        self.budgets: list[BudgetHold | None] = []

    async def admit(self, request_id: str, tokens: int, **kw: Any) -> Decision:
        self.budgets.append(kw.get("budget"))
        return Refused("budget", "org", -1, 2_500_000_000, Window(60, 59, 1000, 10_000, 9_000, 6000))


async def test_a_spent_budget_is_429_insufficient_quota_without_retry_after() -> None:
    shared = SpentLimiter()
    hold = BudgetHold("2026-11", 2_500_000_000, 1234, 0.8)
    with pytest.raises(ApiError) as raised:
        await Admission(shared, LocalLimiter(), TierTable.model_validate({})).admit("r", 10, api_key(), hold)
    error = raised.value
    assert shared.budgets == [hold]
    assert (error.status, error.type, error.code) == (429, "insufficient_quota", "insufficient_quota")
    assert "$2.50" in error.message and "Raise the budget" in error.message
    headers = error.headers or {}
    assert "retry-after" not in headers and headers["x-ratelimit-limit-requests"] == "60"


@pytest.mark.parametrize(("billed", "threshold", "exhausted", "due"), [
    (799, None, None, []),
    (800, None, None, ["threshold"]),
    (800, 1000, None, []),
    (1000, 1000, None, ["exhausted"]),
    (1000, 500, 500, ["threshold", "exhausted"]),  # alerted for an older budget: the new one alerts again
])
def test_alerts_are_due_once_per_budget(billed: int, threshold: int | None, exhausted: int | None,
                                        due: list[str]) -> None:
    assert Charged(True, billed, 1000, 0.8, threshold, exhausted).due() == due
    assert Charged(True, billed, None, 0.8, None, None).due() == []
