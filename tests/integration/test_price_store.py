"""The price table in the real Cassandra: a version is never edited (two operators at once: one wins), a new one
starts far enough ahead, the seed stays idempotent, and a processor's stale book reloads before it prices."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
import pytest_asyncio
from cassandra.cluster import Session

from billing.prices import LivePrices, Price, PriceExists, PriceLead, PriceRefused, PriceStore
from runtime.cassandra_client import connect_async
from runtime.settings import REPO_ROOT, Settings

pytestmark = pytest.mark.integration
LEAD = PriceLead(reload_s=60)
JAN = datetime(2026, 1, 1, tzinfo=UTC)


@dataclass
class Clock:
    """The store's idea of now, settable: "an operator added this ten minutes ago"."""

    at: datetime | None = None

    def __call__(self) -> datetime:
        return self.at or datetime.now(UTC)


@pytest_asyncio.fixture(loop_scope="session")
async def session(stack: Settings) -> AsyncIterator[Session]:
    cluster, session = await connect_async(stack.cassandra)
    yield session
    await asyncio.to_thread(cluster.shutdown)


@pytest.fixture()
def clock() -> Clock:
    return Clock()


@pytest_asyncio.fixture(loop_scope="session")
async def store(session: Session, stack: Settings, clock: Clock) -> PriceStore:
    return await asyncio.to_thread(PriceStore, session, stack.cassandra.keyspace, LEAD, clock=clock)


def model() -> str:
    return f"m-{uuid.uuid4().hex[:10]}"  # the test keyspace is shared: every test prices its own model


def price(name: str, at: datetime, label: str, output: str = "0.20") -> Price:
    return Price(name, at, label, Decimal("0.05"), Decimal("0.025"), Decimal(output))


async def stored(store: PriceStore, name: str) -> list[Price]:
    return [p for p in (await store.load()).all() if p.model == name]


async def test_two_operators_adding_the_same_version_at_once_cannot_both_win(store: PriceStore) -> None:
    name = model()
    await store.add(price(name, JAN, "v1"))
    at = datetime.now(UTC) + timedelta(days=1)
    ours, theirs = price(name, at, "v2-ours", output="0.30"), price(name, at, "v2-theirs", output="0.90")
    results = await asyncio.gather(store.add(ours), store.add(theirs), return_exceptions=True)
    assert sorted(type(r).__name__ for r in results) == ["NoneType", "PriceExists"]
    winner = ours if results[0] is None else theirs
    assert await stored(store, name) == [price(name, JAN, "v1"), winner]


async def test_adding_an_existing_valid_from_fails_and_never_edits_it(store: PriceStore) -> None:
    name = model()
    first = price(name, datetime.now(UTC) + timedelta(days=1), "v1")
    await store.add(first)
    with pytest.raises(PriceExists, match="never edited"):
        await store.add(replace(first, version="v1-fixed", output_per_mtok=Decimal("99")))
    assert await stored(store, name) == [first]


async def test_a_past_or_too_near_valid_from_is_refused(store: PriceStore) -> None:
    name = model()
    await store.add(price(name, JAN, "v1"))  # a model's first price may start in the past: nothing was billed
    with pytest.raises(PriceRefused, match="in the past"):
        await store.add(price(name, datetime.now(UTC) - timedelta(minutes=1), "v2"))
    with pytest.raises(PriceRefused, match="at least 3 min"):
        await store.add(price(name, datetime.now(UTC) + timedelta(minutes=1), "v2"))
    assert await stored(store, name) == [price(name, JAN, "v1")]


async def test_the_seed_is_idempotent_and_never_edits_a_stored_version(store: PriceStore) -> None:
    name = model()
    seed = [price(name, JAN, "v1"), price(name, datetime(2026, 6, 1, tzinfo=UTC), "v2", output="0.4")]
    await store.seed(seed)
    await store.seed(seed)  # every start provisions again
    with pytest.raises(PriceExists, match="never edited"):
        await store.seed([replace(seed[1], output_per_mtok=Decimal("0.5"))])
    assert await stored(store, name) == seed


async def test_a_stale_book_is_reloaded_before_it_prices(store: PriceStore, clock: Clock) -> None:
    """A processor whose reloads failed for ten minutes must not bill at the price it had then."""
    name = model()
    await store.add(price(name, JAN, "v1"))
    ten_minutes_ago = datetime.now(UTC).replace(microsecond=0) - timedelta(minutes=10)
    clock.at = ten_minutes_ago - timedelta(seconds=1)
    live = LivePrices(store, await store.load())  # its last successful load
    clock.at = ten_minutes_ago  # an operator adds v2, as far ahead as required
    await store.add(price(name, ten_minutes_ago + LEAD.minimum, "v2", output="0.9"))
    clock.at = None
    requested_at = datetime.now(UTC) - timedelta(minutes=1)  # v2 applies since six minutes ago
    assert (await live.book_for(requested_at)).price_at(name, requested_at).version == "v2"


def kns(service_env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ops.cli", "billing", *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=60, env={**service_env, "COLUMNS": "250"})


async def test_set_price_refuses_an_edit_and_a_past_start_in_one_line(store: PriceStore,
                                                                      service_env: dict[str, str]) -> None:
    name = model()
    await store.add(price(name, JAN, "v1"))
    rates = ["--input", "0.1", "--cached-input", "0.05", "--output", "0.4"]
    edit = await asyncio.to_thread(kns, service_env, "set-price", "--model", name, "--version", "v1-new",
                                   "--valid-from", JAN.isoformat(), *rates)
    assert edit.returncode == 1 and "never edited" in edit.stderr and edit.stderr.count("\n") == 1, edit.stderr
    past = await asyncio.to_thread(kns, service_env, "set-price", "--model", name, "--version", "v2",
                                   "--valid-from", (datetime.now(UTC) - timedelta(hours=1)).isoformat(), *rates)
    assert past.returncode == 1 and "at least 3 min" in past.stderr and past.stderr.count("\n") == 1, past.stderr
    later = (datetime.now(UTC) + timedelta(minutes=5)).replace(microsecond=0)
    ok = await asyncio.to_thread(kns, service_env, "set-price", "--model", name, "--version", "v2",
                                 "--valid-from", later.isoformat(), *rates)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert [p.version for p in await stored(store, name)] == ["v1", "v2"]
