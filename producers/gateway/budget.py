"""Budget holds: what a request may cost at most, checked against its org's monthly budget at admission.

A hold is the request's prompt at the uncached input rate plus ``max_tokens`` of output, priced with the version
the billing processor will bill it with (the book is reloaded on the billing processor's interval; between two
loads the newest known version stands in, an estimate that only sizes the hold). The billing processor replaces
the hold with the ledger's cost (``runtime/spend.py``), so the spend admission sees is billing's own figure plus
these upper bounds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from datetime import datetime

from billing.prices import LivePrices, UnknownPrice
from runtime.spend import BudgetHold, month_of, nanos_of_micros, to_nanos
from schemas.events import OrgRecord

log = logging.getLogger(__name__)


class HoldPricer:
    def __init__(self, prices: LivePrices, reload_s: float) -> None:
        self._prices = prices
        self._reload_s = reload_s
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._reload(), name="price-reload")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _reload(self) -> None:
        while True:
            await asyncio.sleep(self._reload_s)
            try:
                await self._prices.reload()
            except Exception as exc:  # the book in hand keeps sizing holds; this loop must not end
                log.warning("price reload failed", extra={"reason": repr(exc)})

    def hold(self, org: OrgRecord, model: str, prompt_tokens: int, max_tokens: int, at: datetime) -> BudgetHold:
        """An org without a budget gets a hold of nothing (its admission records that it has no budget)."""
        if org.monthly_budget_micros is None:
            return BudgetHold(month_of(at), None, 0, org.budget_alert_fraction)
        try:
            price = self._prices.book.price_at(model, at, vouch=False)
            nanos = to_nanos(price.cost(prompt_tokens, max_tokens, 0))
        except UnknownPrice:
            nanos = 0  # billing cannot charge it either (it is dead-lettered for an operator to price)
        return BudgetHold(month_of(at), nanos_of_micros(org.monthly_budget_micros), nanos,
                          org.budget_alert_fraction)
