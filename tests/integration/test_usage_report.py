"""``GET /v1/usage`` on the real Cassandra: answered from the hourly aggregates, the same sums as the ledger's rows,
and only the ledger rows of the hours its range cuts (or that billing has not recomputed yet) are read."""

from __future__ import annotations

import asyncio
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from types import SimpleNamespace
from typing import Any

import pytest
import pytest_asyncio

from billing import ledger as ledger_module
from billing.ledger import Ledger, LedgerRow, Totals, utc
from billing.prices import Price, PriceBook
from producers.gateway.routes.usage import usage as usage_route
from runtime.cassandra_client import connect_async
from runtime.settings import Settings
from schemas.events import UsageEvent
from tests.fakes.tenancy import api_key, local_admission

pytestmark = pytest.mark.integration
#: three days from midnight; each test seeds an org of its own
DAY0 = datetime(2026, 2, 10, tzinfo=UTC)
SINCE = datetime(2026, 1, 1, tzinfo=UTC)
PRICES = PriceBook([Price("m1", SINCE, "v1", Decimal("1.1"), Decimal("0.3"), Decimal("2.7")),
                    Price("m2", SINCE, "v1", Decimal("0.7"), Decimal("0.1"), Decimal("1.9"))])


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def ledger(stack: Settings) -> AsyncIterator[Ledger]:
    cluster, session = await connect_async(stack.cassandra)
    yield await Ledger.open(session, stack.cassandra.keyspace)
    await asyncio.to_thread(cluster.shutdown)


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def seeded(ledger: Ledger) -> tuple[str, list[LedgerRow]]:
    """An org of this module's own, its ledger rows billed and its hours recomputed."""
    org = f"org-usage-{uuid.uuid4().hex[:8]}"
    return org, await _seed(ledger, org)


def _usage(org: str, at: datetime, n: int) -> UsageEvent:
    return UsageEvent(request_id=f"req-{uuid.uuid4().hex}", org_id=org, key_id=f"k{n % 3}", tier="plus",
                      model=f"m{n % 2 + 1}", prompt_tokens=10 + n, completion_tokens=n % 7, cached_tokens=n % 4,
                      finish_reason="stop", attempt=0, worker_id="w", requested_at=at, started_at=at, finished_at=at)


async def _seed(ledger: Ledger, org: str) -> list[LedgerRow]:
    """Rows over three days: every 37 minutes (so at odd minutes of most hours), keys and models mixed."""
    times = [DAY0 + timedelta(minutes=37 * n, seconds=n % 60, milliseconds=n) for n in range(3 * 24 * 60 // 37)]
    rows = [LedgerRow.from_usage(_usage(org, at, n), PRICES) for n, at in enumerate(times)]
    semaphore = asyncio.Semaphore(4)  # LWT inserts: a loaded single node times out a burst of them

    async def one(row: LedgerRow) -> None:
        async with semaphore:
            await ledger.record(row)

    await asyncio.gather(*(one(row) for row in rows))
    await ledger.flush_dirty()
    return rows


def _by_model(model: str, _at: datetime) -> str:
    return model


def _by_day(_model: str, at: datetime) -> str:
    return at.date().isoformat()


async def _from_rows(ledger: Ledger, org: str, start: datetime, end: datetime,
                     label: Callable[[str, datetime], str]) -> dict[str, Totals]:
    """The answer the report gave before: every ledger row of the range, summed."""
    groups: dict[str, Totals] = defaultdict(Totals)
    for row in await ledger.rows_for_org(org, start, end):
        name = label(row["model"], utc(row["requested_at"]))
        groups[name] = groups[name].add(row)
    return dict(groups)


RANGES = [
    (DAY0, DAY0 + timedelta(days=3)),  # whole hours only
    (DAY0 + timedelta(hours=5, minutes=13, seconds=7), DAY0 + timedelta(days=2, hours=7, minutes=41)),  # cut hours
    (DAY0 + timedelta(hours=23, minutes=30), DAY0 + timedelta(days=1, minutes=50)),  # across midnight, no whole hour
    (DAY0 + timedelta(hours=3, minutes=5), DAY0 + timedelta(hours=3, minutes=55)),  # inside one hour
    (DAY0 + timedelta(hours=2, minutes=59), DAY0 + timedelta(hours=4, minutes=1)),  # one whole hour, two cut ones
]


async def test_the_aggregate_answer_equals_the_sum_of_the_ledger_rows(ledger: Ledger,
                                                                       seeded: tuple[str, list[LedgerRow]]) -> None:
    org, rows = seeded
    for start, end in RANGES:
        for label in (_by_model, _by_day):
            expected = await _from_rows(ledger, org, start, end, label)
            assert expected, "the range holds rows"
            assert await ledger.usage(org, start, end, label) == expected, (start, end, label.__name__)
    whole = await ledger.usage(org, DAY0, DAY0 + timedelta(days=3), _by_model)
    assert sum(whole.values(), Totals()).requests >= len(rows)


async def test_an_hour_billed_after_its_recomputation_is_summed_from_the_ledger(
        ledger: Ledger, seeded: tuple[str, list[LedgerRow]]) -> None:
    org, _ = seeded
    start, end = DAY0 + timedelta(days=2, hours=12), DAY0 + timedelta(days=3)
    before = await ledger.usage(org, start, end, _by_model)
    late = LedgerRow.from_usage(_usage(org, DAY0 + timedelta(days=2, hours=20, minutes=1), 5), PRICES)
    await ledger.record(late)  # marks its (closed) hour dirty: its aggregate does not count it yet
    answer = await ledger.usage(org, start, end, _by_model)
    assert answer == await _from_rows(ledger, org, start, end, _by_model)
    assert answer[late.model].requests == before[late.model].requests + 1


async def test_a_usage_report_reads_only_the_ledger_rows_of_the_hours_its_range_cuts(
        ledger: Ledger, seeded: tuple[str, list[LedgerRow]], monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, ``/v1/usage`` loaded every ledger row of the range (up to 93 days) into the gateway at once. Here
    the rows that Cassandra hands the gateway from ``ledger_by_org_day`` are counted, whichever way they are read."""
    org, rows = seeded
    start, end = DAY0 + timedelta(hours=5, minutes=13), DAY0 + timedelta(days=2, hours=7, minutes=41)
    read: list[int] = []

    def counted(statement: Any, rows: int) -> None:
        if "ledger_by_org_day" in getattr(statement, "query_string", str(statement)):
            read.append(rows)

    execute, pages = ledger_module.execute, getattr(ledger_module, "pages", None)

    async def counting_execute(session: Any, statement: Any, params: Any = None) -> list[dict[str, Any]]:
        result = await execute(session, statement, params)
        counted(statement, len(result))
        return result

    async def counting_pages(session: Any, statement: Any, params: Any = None, **kw: Any
                             ) -> AsyncIterator[list[dict[str, Any]]]:
        assert pages is not None
        async for page in pages(session, statement, params, **kw):
            counted(statement, len(page))
            yield page

    monkeypatch.setattr(ledger_module, "execute", counting_execute)
    monkeypatch.setattr(ledger_module, "pages", counting_pages, raising=False)
    ctx = SimpleNamespace(ledger=ledger, admission=local_admission())
    body = await usage_route(ctx, api_key(org_id=org),  # type: ignore[arg-type]
                             start=start.isoformat(), end=end.isoformat(), group_by="model")
    in_range = [r for r in rows if start <= r.requested_at < end]
    assert body["total"]["requests"] == len(in_range)
    cut = [r for r in in_range if r.hour in (start.replace(minute=0), end.replace(minute=0))]
    assert sum(read) == len(cut), f"{sum(read)} ledger rows read for a range of {len(in_range)}"


async def test_small_pages_give_the_same_answer(ledger: Ledger, seeded: tuple[str, list[LedgerRow]],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Every read pages (``runtime.cassandra_client.pages``): with pages of three rows, each query takes several."""
    org, _ = seeded
    start, end = RANGES[1]
    whole_pages = await ledger.usage(org, start, end, _by_day)
    monkeypatch.setattr(ledger_module, "PAGE_ROWS", 3)
    assert await ledger.usage(org, start, end, _by_day) == whole_pages == await _from_rows(ledger, org, start, end,
                                                                                           _by_day)
