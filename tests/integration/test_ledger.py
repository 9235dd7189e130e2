"""The billing ledger in the real Cassandra: first usage wins, views agree, aggregates are derived and exact; each
row records the price version it was billed with, and repair never re-prices a billed row."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
import pytest_asyncio

from billing.ledger import Ledger, LedgerRow
from billing.prices import Price, PriceBook
from billing.reconcile import reconcile
from billing.replay import UsageReplay
from runtime.cassandra_client import connect_async, execute
from runtime.redis_client import make_redis
from runtime.settings import Settings
from runtime.spend import SpendBook, month_of, to_nanos
from schemas.events import UsageEvent

pytestmark = pytest.mark.integration
HOUR = datetime(2026, 3, 4, 10, 0, tzinfo=UTC)
PRICES = PriceBook([Price("m", datetime(2026, 1, 1, tzinfo=UTC), "v1", Decimal("1"), Decimal("0.5"), Decimal("2")),
                    Price("m", datetime(2026, 3, 4, 10, 30, tzinfo=UTC), "v2", Decimal("10"), Decimal("5"),
                          Decimal("20"))])


@pytest_asyncio.fixture(loop_scope="session")
async def ledger(stack: Settings) -> AsyncIterator[Ledger]:
    cluster, session = await connect_async(stack.cassandra)
    yield await Ledger.open(session, stack.cassandra.keyspace)
    await asyncio.to_thread(cluster.shutdown)


def usage(org: str, minute: int, completion: int = 4, attempt: int = 1, key: str = "k1") -> UsageEvent:
    at = HOUR + timedelta(minutes=minute)
    return UsageEvent(request_id=f"req-{uuid.uuid4().hex}", org_id=org, key_id=key, tier="pro", model="m",
                      prompt_tokens=10, completion_tokens=completion, cached_tokens=2, finish_reason="stop",
                      attempt=attempt, worker_id="w", requested_at=at, started_at=at, finished_at=at)


async def test_the_first_usage_of_a_request_wins_and_replays_change_nothing(ledger: Ledger) -> None:
    org = f"org-{uuid.uuid4().hex[:8]}"
    first = usage(org, 5)
    regenerated = first.model_copy(update={"completion_tokens": 99, "attempt": 2})
    row, created = await ledger.record(LedgerRow.from_usage(first, PRICES))
    assert created and row.completion_tokens == 4
    again, created_again = await ledger.record(LedgerRow.from_usage(regenerated, PRICES))
    assert not created_again and again == row  # the winner comes back, nothing is billed twice
    (view,) = await ledger.rows_for_org(org, HOUR, HOUR + timedelta(hours=1))
    assert view["completion_tokens"] == 4 and view["cost"] == row.cost


async def test_cost_uses_the_price_valid_at_the_request_time(ledger: Ledger) -> None:
    before = LedgerRow.from_usage(usage("o", 29), PRICES)
    after = LedgerRow.from_usage(usage("o", 31), PRICES)
    # (8 uncached * 1 + 2 cached * 0.5 + 4 * 2) / 1e6, then ten times that
    assert (before.price_version, before.cost) == ("v1", Decimal("0.000017"))
    assert (after.price_version, after.cost) == ("v2", Decimal("0.00017"))


async def test_hourly_aggregates_are_recomputed_from_the_ledger(ledger: Ledger, stack: Settings) -> None:
    org = f"org-{uuid.uuid4().hex[:8]}"
    rows = [LedgerRow.from_usage(usage(org, m, completion=c, key=k), PRICES)
            for m, c, k in ((1, 3, "k1"), (2, 5, "k1"), (3, 7, "k2"), (29, 1, "k1"))]
    for row in rows:
        await ledger.record(row)
    flushed = await ledger.flush_dirty()
    assert flushed >= 1
    hourly = {(r["key_id"], r["model"]): r for r in await ledger.hourly(org, HOUR.date())}
    assert hourly[("k1", "m")]["requests"] == 3 and hourly[("k1", "m")]["completion_tokens"] == 9
    assert hourly[("k2", "m")]["completion_tokens"] == 7
    assert hourly[("k1", "m")]["cost"] == sum((r.cost for r in rows if r.key_id == "k1"), Decimal(0))
    # recomputing again (a replay) gives the same numbers, never double
    await ledger.recompute_hour(org, HOUR)
    again = {(r["key_id"], r["model"]): r for r in await ledger.hourly(org, HOUR.date())}
    assert again == hourly
    marks = await execute(ledger._session, f"SELECT org_id FROM {stack.cassandra.keyspace}.dirty_hours")
    assert org not in {m["org_id"] for m in marks}


async def test_correct_repairs_a_corrupted_row_billed_with_the_same_version(ledger: Ledger) -> None:
    org = f"org-{uuid.uuid4().hex[:8]}"
    good = LedgerRow.from_usage(usage(org, 10), PRICES)
    await ledger.record(replace(good, completion_tokens=1234))  # what a corruption would look like
    assert await ledger.correct(good)
    assert await ledger.get(good.request_id) == good
    (view,) = await ledger.rows_for_org(org, HOUR, HOUR + timedelta(hours=1))
    assert view["completion_tokens"] == good.completion_tokens
    # a row billed with another version than the correction assumes is left alone
    assert not await ledger.correct(replace(good, price_version="v2", cost=Decimal(1)))
    assert await ledger.get(good.request_id) == good


async def test_a_ledger_row_records_exactly_which_price_version_billed_it(ledger: Ledger) -> None:
    row = LedgerRow.from_usage(usage(f"org-{uuid.uuid4().hex[:8]}", 31), PRICES)
    await ledger.record(row)
    stored = await ledger.get(row.request_id)
    assert stored is not None and (stored.price_version, stored.price_valid_from) == ("v2", PRICES.all()[1].valid_from)


async def test_repair_restores_usage_but_never_reprices_a_billed_row(ledger: Ledger, stack: Settings) -> None:
    org = f"org-{uuid.uuid4().hex[:8]}"
    kept, corrupted, lost = usage(org, 5), usage(org, 6), usage(org, 7)
    billed = {u.request_id: LedgerRow.from_usage(u, PRICES) for u in (kept, corrupted)}
    for row in billed.values():
        await ledger.record(row)
    await execute(ledger._session, f"UPDATE {stack.cassandra.keyspace}.ledger_by_request SET completion_tokens = 4242 "
                                   "WHERE request_id = %s", (corrupted.request_id,))
    # After billing, a version valid from before these requests appeared (what `set-price` used to accept).
    changed = PriceBook([*PRICES.all(), Price("m", HOUR, "v1b", Decimal("100"), Decimal("50"), Decimal("200"))])
    events = [kept, corrupted, lost]
    replay = UsageReplay([(0, i, u) for i, u in enumerate(events)], {u.request_id: u for u in events})
    redis = make_redis(stack.redis)
    spend = SpendBook(redis, stack.redis)
    try:
        report = await reconcile(ledger, changed, replay, HOUR, HOUR + timedelta(hours=1), repair=True, org_id=org,
                                 spend=spend)
        # what the repair billed is charged to the org's spend: the lost row, and the corrected one (this test wrote
        # the rows without the billing processor, so nothing had charged it); the untouched row is not
        assert (await spend.read(org, month_of(HOUR))).billed_nanos == to_nanos(
            changed.price_at("m", lost.requested_at).cost(10, 4, 2)) + to_nanos(billed[corrupted.request_id].cost)
    finally:
        await redis.aclose()

    assert await ledger.get(kept.request_id) == billed[kept.request_id]  # its cost is final
    assert await ledger.get(corrupted.request_id) == billed[corrupted.request_id]  # tokens back, cost at v1
    inserted = await ledger.get(lost.request_id)  # never billed: billed now, at the price valid at its time
    assert inserted is not None and inserted.price_version == "v1b"
    assert inserted.cost == changed.price_at("m", lost.requested_at).cost(10, 4, 2)
    kinds = sorted((d.kind, d.request_id == kept.request_id) for d in report.discrepancies)
    assert kinds == [("mismatched", False), ("missing", False), ("repriced", False), ("repriced", True)]
    assert report.repaired == 2 and not report.clean  # the repriced rows stay reported, for an operator
