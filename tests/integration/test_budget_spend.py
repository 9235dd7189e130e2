"""Monthly budgets on the real Redis (issue 9 item 3): admission refuses a request that could take an org past its
budget, holds what admitted requests may cost, and billing's charges replace the holds exactly once."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime
from decimal import Decimal

import pytest

from runtime.limiter import Admitted, Limits, RateLimiter, Refused
from runtime.redis_client import make_redis
from runtime.settings import Settings
from runtime.spend import BudgetHold, SpendBook, month_of, to_nanos

pytestmark = pytest.mark.integration
WIDE = Limits(requests_per_minute=1_000_000, tokens_per_minute=10**12, max_concurrent=1_000_000)
NOW = datetime.now(UTC)
MONTH = month_of(NOW)


def _org() -> str:
    return f"org-{uuid.uuid4().hex[:8]}"


def _hold(budget: int, hold: int, fraction: float = 0.8) -> BudgetHold:
    return BudgetHold(MONTH, budget, hold, fraction)


async def _admit(limiter: RateLimiter, org: str, rid: str, budget: BudgetHold) -> Admitted | Refused:
    return await limiter.admit(rid, 10, key_id=f"key-{org}", org_id=org, key_limits=WIDE, org_limits=WIDE,
                               budget=budget)


async def test_concurrent_admissions_never_hold_more_than_the_budget(stack: Settings) -> None:
    clients = [make_redis(stack.redis) for _ in range(3)]
    limiters = [RateLimiter(c, stack.redis) for c in clients]
    org = _org()
    try:
        answers = await asyncio.gather(*(_admit(limiters[i % 3], org, f"r{i}-{uuid.uuid4().hex}", _hold(1000, 70))
                                         for i in range(50)))
        spend = await SpendBook(clients[0], stack.redis).read(org, MONTH)
    finally:
        for client in clients:
            await client.aclose()
    admitted = [a for a in answers if isinstance(a, Admitted)]
    refused = [a for a in answers if isinstance(a, Refused)]
    assert len(admitted) == 1000 // 70
    assert {(r.limit, r.scope, r.retry_after_ms, r.value) for r in refused} == {("budget", "org", -1, 1000)}
    assert (spend.billed_nanos, spend.reserved_nanos, spend.holds) == (0, 70 * len(admitted), len(admitted))


async def test_a_charge_replaces_the_hold_once_and_an_unbilled_end_drops_it(stack: Settings) -> None:
    redis = make_redis(stack.redis)
    limiter, book = RateLimiter(redis, stack.redis), SpendBook(redis, stack.redis)
    org = _org()
    try:
        billed, unbilled = f"b-{uuid.uuid4().hex}", f"u-{uuid.uuid4().hex}"
        assert isinstance(await _admit(limiter, org, billed, _hold(10_000, 4000)), Admitted)
        assert isinstance(await _admit(limiter, org, unbilled, _hold(10_000, 4000)), Admitted)
        assert isinstance(await _admit(limiter, org, "third", _hold(10_000, 4000)), Refused)  # 8000 + 4000 > 10000

        # the worker settles both after its commit: the unbilled one's hold goes, the billed one's waits for billing
        assert await limiter.settle_many([(billed, 30, True), (unbilled, 0, False)]) == 2
        assert await book.read(org, MONTH) == type(await book.read(org, MONTH))(0, 4000, 1)

        cost = Decimal("0.0000012345")  # 1234.5 nano-dollars: rounded half up
        charges = await asyncio.gather(*(book.charge(billed, org, NOW, cost) for _ in range(5)))  # redeliveries
        assert [c.applied for c in charges].count(True) == 1
        spend = await book.read(org, MONTH)
        assert (spend.billed_nanos, spend.reserved_nanos, spend.holds) == (to_nanos(cost), 0, 0) == (1235, 0, 0)
    finally:
        await redis.aclose()


async def test_raising_the_budget_admits_at_once_and_alerts_are_due_once_per_budget(stack: Settings) -> None:
    redis = make_redis(stack.redis)
    limiter, book = RateLimiter(redis, stack.redis), SpendBook(redis, stack.redis)
    org = _org()
    try:
        first = f"r-{uuid.uuid4().hex}"
        assert isinstance(await _admit(limiter, org, first, _hold(1000, 900, 0.5)), Admitted)
        await limiter.settle(first, 10, billed=True)
        charged = await book.charge(first, org, NOW, Decimal("0.000000950"))  # billed 950 of 1000: both lines crossed
        assert charged.due() == ["threshold"]  # 950 < 1000: not exhausted
        await book.alerted(org, MONTH, "threshold", 1000)
        assert (await book.charge(first, org, NOW, Decimal("0.000000950"))).due() == []  # a redelivery: nothing new

        refused = await _admit(limiter, org, f"r-{uuid.uuid4().hex}", _hold(1000, 100, 0.5))
        assert isinstance(refused, Refused) and refused.limit == "budget"
        # the operator raises the budget: the next admission carries it and is served
        second = f"r-{uuid.uuid4().hex}"
        assert isinstance(await _admit(limiter, org, second, _hold(5000, 100, 0.5)), Admitted)
        await limiter.settle(second, 10, billed=True)
        charged = await book.charge(second, org, NOW, Decimal("0.000004100"))  # 5050 of 5000
        assert charged.billed_nanos == 5050 and charged.due() == ["threshold", "exhausted"]  # new budget: again
    finally:
        await redis.aclose()


async def test_a_hold_nobody_ended_lapses(stack: Settings) -> None:
    redis = make_redis(stack.redis)
    limiter = RateLimiter(redis, stack.redis, reservation_ttl_s=1)
    org = _org()
    try:
        assert isinstance(await _admit(limiter, org, "lost", _hold(1000, 800)), Admitted)  # its request is lost
        assert isinstance(await _admit(limiter, org, "next", _hold(1000, 800)), Refused)
        await asyncio.sleep(1.2)
        assert isinstance(await _admit(limiter, org, "later", _hold(1000, 800)), Admitted)
        spend = await SpendBook(redis, stack.redis).read(org, MONTH)
        assert (spend.reserved_nanos, spend.holds) == (800, 1)
    finally:
        await redis.aclose()


async def test_an_org_without_a_budget_keeps_no_holds(stack: Settings) -> None:
    redis = make_redis(stack.redis)
    limiter, book = RateLimiter(redis, stack.redis), SpendBook(redis, stack.redis)
    org = _org()
    try:
        rid = f"r-{uuid.uuid4().hex}"
        assert isinstance(await limiter.admit(rid, 10, key_id="k", org_id=org, key_limits=WIDE, org_limits=WIDE),
                          Admitted)
        assert await book.read(org, MONTH) == type(await book.read(org, MONTH))(0, 0, 0)
        charged = await book.charge(rid, org, NOW, Decimal("1.5"))  # billing still counts its spend
        assert (charged.billed_nanos, charged.budget_nanos, charged.due()) == (1_500_000_000, None, [])
    finally:
        await redis.aclose()
