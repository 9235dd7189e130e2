"""Adversarial review of monthly budgets (issue 9 item 3) on the real Redis (and Cassandra where the ledger is part of
the story). Each test states a promise of the change and a sequence of faults that breaks it."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from redis.asyncio import Redis

from billing.cli import _spend
from billing.ledger import Ledger, LedgerRow
from billing.prices import PriceBook, load_seed
from billing.reconcile import reconcile
from billing.replay import UsageReplay
from runtime.cassandra_client import connect_async
from runtime.limiter import Admitted, Limits, RateLimiter, Refused
from runtime.redis_client import key as redis_key
from runtime.redis_client import make_redis
from runtime.settings import Settings
from runtime.spend import BudgetHold, SpendBook, month_of, to_nanos
from schemas.events import UsageEvent

pytestmark = pytest.mark.integration
WIDE = Limits(requests_per_minute=1_000_000, tokens_per_minute=10**12, max_concurrent=1_000_000)


def _org() -> str:
    return f"org-review-{uuid.uuid4().hex[:8]}"


def _rid() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


async def _admit(limiter: RateLimiter, org: str, rid: str, budget: BudgetHold | None) -> Admitted | Refused:
    return await limiter.admit(rid, 10, key_id=f"key-{org}", org_id=org, key_limits=WIDE, org_limits=WIDE,
                               budget=budget)


def _usage(org: str, at: datetime, prompt: int = 1000, completion: int = 500) -> UsageEvent:
    (seed,) = load_seed()
    return UsageEvent(request_id=_rid(), org_id=org, key_id=f"key-{org}", tier="pro", model=seed.model,
                      prompt_tokens=prompt, completion_tokens=completion, cached_tokens=0, finish_reason="stop",
                      attempt=1, worker_id="w", requested_at=at, started_at=at, finished_at=at)


@asynccontextmanager
async def _stores(stack: Settings) -> AsyncIterator[tuple[Ledger, Redis, SpendBook]]:
    """The ledger (Cassandra) and the spend (Redis) a test reads and writes."""
    cluster, session = await connect_async(stack.cassandra)
    redis = make_redis(stack.redis)
    try:
        yield await Ledger.open(session, stack.cassandra.keyspace), redis, SpendBook(redis, stack.redis)
    finally:
        await redis.aclose()
        await asyncio.to_thread(cluster.shutdown)


async def _wipe(redis: Redis, stack: Settings, org: str, month: str, *request_ids: str) -> None:
    """What a Redis restart without persistence leaves of this org-month: nothing (marks included)."""
    book = SpendBook(redis, stack.redis)
    await redis.delete(*book.keys(org, month).all(),
                       *(redis_key(stack.redis, "spend", "charged", rid) for rid in request_ids))


# --- 1. spend never drifts from the ledger --------------------------------------------------------------------


async def test_reconcile_repair_bills_into_the_ledger_and_the_spend_alike(stack: Settings) -> None:
    """A usage event billing dead-lettered (UnknownPrice: "kept for an operator: add the price, then repair") is
    billed by ``kns billing reconcile --repair`` (Repair 'insert'). The ledger gains the row; the spend admission
    checks the budget against never hears of it, so billed != ledger sum for good (and the org is admitted past its
    budget by that much)."""
    (seed,) = load_seed()
    org, now = _org(), datetime.now(UTC).replace(microsecond=0)
    lost = _usage(org, now - timedelta(seconds=5))
    replay = UsageReplay(records=[(0, 0, lost)], first={lost.request_id: lost})
    async with _stores(stack) as (ledger, _redis, book):
        report = await reconcile(ledger, PriceBook([seed]), replay, now - timedelta(minutes=1),
                                 now + timedelta(minutes=1), repair=True, org_id=org, spend=book)
        assert report.repaired == 1
        row = await ledger.get(lost.request_id)
        assert row is not None
        spend = await book.read(org, month_of(row.requested_at))
        assert spend.billed_nanos == to_nanos(row.cost), "reconcile --repair billed a row the spend never counts"


async def test_spend_repair_while_billing_runs_counts_a_pending_charge_once(stack: Settings) -> None:
    """``kns billing spend --repair`` after a Redis wipe: the billing processor had written request b's ledger row
    and was retrying its charge while Redis was away. The repair reads the ledger (b included) and HSETs billed;
    the processor's retry then lands. In the first version it added b again (its mark was wiped with the rest)."""
    org, now = _org(), datetime.now(UTC)
    month = month_of(now)
    (seed,) = load_seed()
    book_prices = PriceBook([seed])
    a, b = (LedgerRow.from_usage(_usage(org, now), book_prices) for _ in range(2))
    async with _stores(stack) as (ledger, redis, book):
        await ledger.record(a)
        await book.charge(a.request_id, org, a.requested_at, a.cost)
        await ledger.record(b)  # the processor's next step, charge(b), is retried: Redis restarts meanwhile
        await _wipe(redis, stack, org, month, a.request_id, b.request_id)
        _before, ledger_nanos, repaired = await _spend(org, month, True)
        assert repaired is not None and repaired.billed_nanos == ledger_nanos == to_nanos(a.cost + b.cost)
        await book.charge(b.request_id, org, b.requested_at, b.cost)  # the processor's retry lands
        billed = (await book.read(org, month)).billed_nanos
        assert billed == ledger_nanos, f"billed {billed} != ledger {ledger_nanos}: b was counted twice"


async def test_a_redelivered_usage_event_after_a_wipe_and_repair_is_not_charged_again(stack: Settings) -> None:
    """A usage event charged before the wipe and redelivered after the repair (the billing processor restarted
    before its offsets were committed). In the first version the repair restored ``billed`` but not the
    per-request charge marks, and the redelivery was charged a second time."""
    org, now = _org(), datetime.now(UTC)
    month = month_of(now)
    (seed,) = load_seed()
    a = LedgerRow.from_usage(_usage(org, now), PriceBook([seed]))
    async with _stores(stack) as (ledger, redis, book):
        await ledger.record(a)
        await book.charge(a.request_id, org, a.requested_at, a.cost)
        await _wipe(redis, stack, org, month, a.request_id)
        _before, ledger_nanos, _repaired = await _spend(org, month, True)
        winner, created = await ledger.record(a)  # the redelivery: the ledger dedupes it ...
        assert not created
        charged = await book.charge(winner.request_id, org, winner.requested_at, winner.cost)  # ... the spend not
        assert not charged.applied and charged.billed_nanos == ledger_nanos, "charged twice after the repair"


# --- 2. an org is never admitted past its budget ----------------------------------------------------------------


async def test_the_hold_of_a_billed_request_does_not_lapse_while_billing_lags(stack: Settings) -> None:
    """The worker settled request 1 as billed: its hold is now the billing processor's to replace. Billing is
    down (or behind) for longer than the reservation TTL: the hold lapses as if the request were lost, admission
    lets request 2 in, and when billing catches up the org has spent 1600 of its 1000."""
    redis = make_redis(stack.redis)
    limiter, book = RateLimiter(redis, stack.redis, reservation_ttl_s=1), SpendBook(redis, stack.redis)
    org, now = _org(), datetime.now(UTC)
    month = month_of(now)
    try:
        first, second = _rid(), _rid()
        assert isinstance(await _admit(limiter, org, first, BudgetHold(month, 1000, 800, 0.8)), Admitted)
        assert await limiter.settle(first, 30, billed=True)  # committed with usage: billing will charge it
        await asyncio.sleep(1.3)  # the billing processor is still behind
        answer = await _admit(limiter, org, second, BudgetHold(month, 1000, 800, 0.8))
        if isinstance(answer, Admitted):  # what billing then charges
            await limiter.settle(second, 30, billed=True)
            await book.charge(first, org, now, Decimal("0.000000800"))
            await book.charge(second, org, now, Decimal("0.000000800"))
        billed = (await book.read(org, month)).billed_nanos
        assert isinstance(answer, Refused), f"admitted past the budget: billed {billed} of 1000"
    finally:
        await redis.aclose()


# --- 3. reserved returns to 0 -----------------------------------------------------------------------------------


async def test_a_lapsed_hold_leaves_the_spend_once_its_ttl_is_over(stack: Settings) -> None:
    """A hold nobody ends (worker SIGKILLed between its commit and its settlement of an unbilled final; a produce
    that timed out and never landed; a request of the month that just ended) is only swept by a later admission of
    the same org *and month*: after the load ends, ``reserved`` (and ``kns billing spend``'s "held in flight") stay
    up until the keys expire, 40 days later."""
    redis = make_redis(stack.redis)
    limiter, book = RateLimiter(redis, stack.redis, reservation_ttl_s=1), SpendBook(redis, stack.redis)
    org, month = _org(), month_of(datetime.now(UTC))
    try:
        assert isinstance(await _admit(limiter, org, _rid(), BudgetHold(month, 10_000, 800, 0.8)), Admitted)
        await asyncio.sleep(1.3)  # past the reservation TTL; the load is over: no admission of this org follows
        spend = await book.read(org, month)
        assert (spend.reserved_nanos, spend.holds) == (0, 0), f"still held after its TTL: {spend}"
    finally:
        await redis.aclose()


# --- 4. alerts ------------------------------------------------------------------------------------------------


async def test_an_org_whose_budget_was_removed_gets_no_budget_alerts(stack: Settings) -> None:
    """The operator removes the org's budget (monthly_budget_micros = None): admissions carry none, but the
    org-month's sum keeps the last budget an admission wrote, so billing goes on raising threshold and exhausted
    alerts (the latter says its requests now get 429) against a budget the org no longer has."""
    redis = make_redis(stack.redis)
    limiter, book = RateLimiter(redis, stack.redis), SpendBook(redis, stack.redis)
    org, now = _org(), datetime.now(UTC)
    month = month_of(now)
    try:
        old = _rid()
        assert isinstance(await _admit(limiter, org, old, BudgetHold(month, 1000, 100, 0.8)), Admitted)
        await limiter.settle(old, 10, billed=True)
        await book.charge(old, org, now, Decimal("0.000000100"))
        # the budget is removed: the next request is admitted without one (the gateway's hold says so: budget
        # None, holding nothing) and costs 1000 nano-dollars
        new = _rid()
        assert isinstance(await _admit(limiter, org, new, BudgetHold(month, None, 0, 0.8)), Admitted)
        await limiter.settle(new, 10, billed=True)
        charged = await book.charge(new, org, now, Decimal("0.000001000"))
        assert charged.due() == [], f"alerts {charged.due()} raised for a budget of {charged.budget_nanos} the " \
                                    "org no longer has"
    finally:
        await redis.aclose()


async def test_an_org_that_reaches_its_lowered_budget_is_alerted_against_it(stack: Settings) -> None:
    """Alerts are computed against the budget the org's last *admitted* request carried. The operator lowers the
    budget from 5000 to 1000; every later request is refused (so none writes the new budget), and the in-flight
    request's charge takes billed to 1100: past the budget in force, yet no 'exhausted' alert is due (it is judged
    against the old 5000)."""
    redis = make_redis(stack.redis)
    limiter, book = RateLimiter(redis, stack.redis), SpendBook(redis, stack.redis)
    org, now = _org(), datetime.now(UTC)
    month = month_of(now)
    try:
        running = _rid()
        assert isinstance(await _admit(limiter, org, running, BudgetHold(month, 5000, 1200, 0.8)), Admitted)
        refused = await _admit(limiter, org, _rid(), BudgetHold(month, 1000, 100, 0.8))  # the budget is lowered
        assert isinstance(refused, Refused) and refused.limit == "budget"
        await limiter.settle(running, 10, billed=True)
        charged = await book.charge(running, org, now, Decimal("0.000001100"))
        assert charged.billed_nanos == 1100
        assert "exhausted" in charged.due(), f"billed 1100 of a 1000 budget: due {charged.due()} against " \
                                             f"{charged.budget_nanos}"
    finally:
        await redis.aclose()
