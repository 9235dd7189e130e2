"""Listing stored completions on the real Cassandra: a filter is judged on the index (the model and the metadata
ride on each index row), so a listing reads the completion rows of its page only, a bounded number at a time."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import pytest_asyncio

from runtime.cassandra_client import connect_async, execute
from runtime.settings import Settings
from schemas.events import ChatMessage, StoredCompletion, TokenUsage
from stream_processors.store import completions
from stream_processors.store.completions import CompletionStore, month_of

pytestmark = pytest.mark.integration
COMPLETIONS = 45


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def store(stack: Settings) -> AsyncIterator[CompletionStore]:
    cluster, session = await connect_async(stack.cassandra)
    yield await CompletionStore.open(session, stack.cassandra.keyspace)
    await asyncio.to_thread(cluster.shutdown)


def _stored(org: str, created_at: datetime, **metadata: str) -> StoredCompletion:
    return StoredCompletion(completion_id=f"chatcmpl-{uuid.uuid4().hex}", org_id=org, key_id="k", model="m",
                            created_at=created_at, messages=[ChatMessage(role="user", content="hi")],
                            metadata=metadata, text="hello", finish_reason="stop",
                            usage=TokenUsage(prompt_tokens=1, completion_tokens=1))


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def org(store: CompletionStore) -> tuple[str, list[StoredCompletion]]:
    """An org of this module's own: ``COMPLETIONS`` completions a minute apart, one in three tagged, newest first."""
    name = f"org-list-{uuid.uuid4().hex[:8]}"
    now = datetime.now(UTC).replace(microsecond=0)
    written = [_stored(name, now - timedelta(minutes=n), **({"tag": "third"} if n % 3 == 0 else {}))
               for n in range(COMPLETIONS)]
    for each in written:
        await store.write(each)
    return name, written


class Reads:
    """Counts the completion rows a listing reads, and how many at once at most."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = self.in_flight = self.most_at_once = 0
        get = CompletionStore.get

        async def counted(store: CompletionStore, completion_id: str, org_id: str) -> dict[str, Any] | None:
            self.count += 1
            self.in_flight += 1
            self.most_at_once = max(self.most_at_once, self.in_flight)
            try:
                return await get(store, completion_id, org_id)
            finally:
                self.in_flight -= 1

        monkeypatch.setattr(CompletionStore, "get", counted)


async def test_a_filter_that_matches_nothing_reads_no_completion_row(
        store: CompletionStore, org: tuple[str, list[StoredCompletion]], monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, every index row the scan passed (up to 2000) was read back as its completion row, 200 at once, to
    test the filter on it."""
    name, _ = org
    reads = Reads(monkeypatch)
    page = await store.page(name, after=None, limit=20, ascending=False, model=None, metadata={"tag": "none"})
    assert (page.items, page.has_more) == ([], False)
    assert reads.count == 0
    other_model = await store.page(name, after=None, limit=20, ascending=False, model="other", metadata={})
    assert (other_model.items, reads.count) == ([], 0)


async def test_a_filtered_page_reads_the_completions_of_that_page_and_goes_on_from_its_last(
        store: CompletionStore, org: tuple[str, list[StoredCompletion]], monkeypatch: pytest.MonkeyPatch) -> None:
    name, written = org
    tagged = [c.completion_id for c in written if c.metadata]
    reads = Reads(monkeypatch)
    first = await store.page(name, after=None, limit=4, ascending=False, model="m", metadata={"tag": "third"})
    assert [r["completion_id"] for r in first.items] == tagged[:4] and first.has_more
    assert reads.count == 4 + 1  # the page and the one that says there is more
    rest = await store.page(name, after=tagged[3], limit=100, ascending=False, model=None, metadata={"tag": "third"})
    assert [r["completion_id"] for r in rest.items] == tagged[4:] and not rest.has_more
    oldest = await store.page(name, after=None, limit=2, ascending=True, model=None, metadata={"tag": "third"})
    assert [r["completion_id"] for r in oldest.items] == tagged[::-1][:2]


async def test_a_listing_reads_at_most_a_bounded_number_of_completion_rows_at_once(
        store: CompletionStore, org: tuple[str, list[StoredCompletion]], monkeypatch: pytest.MonkeyPatch) -> None:
    name, written = org
    monkeypatch.setattr(completions, "GET_PARALLEL", 4, raising=False)
    reads = Reads(monkeypatch)
    page = await store.page(name, after=None, limit=100, ascending=False, model=None, metadata={})
    assert [r["completion_id"] for r in page.items] == [c.completion_id for c in written]
    assert reads.count == COMPLETIONS and reads.most_at_once == 4


async def test_an_index_row_without_metadata_is_judged_on_its_completion_row(
        store: CompletionStore, stack: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    """Index rows written before the index carried metadata have none: the listing reads their completion rows,
    and still finds what matches."""
    name = f"org-list-{uuid.uuid4().hex[:8]}"
    now = datetime.now(UTC).replace(microsecond=0)
    old = [_stored(name, now - timedelta(minutes=n), **({"tag": "x"} if n == 7 else {})) for n in range(10)]
    for each in old:
        await store.write(each)
        await execute(store._session, f"UPDATE {stack.cassandra.keyspace}.stored_completions_by_org "  # as before
                      "SET metadata_json = null WHERE org_id = %s AND month = %s AND created_at = %s "
                      "AND completion_id = %s", (name, month_of(each.created_at), each.created_at, each.completion_id))
    reads = Reads(monkeypatch)
    page = await store.page(name, after=None, limit=5, ascending=False, model=None, metadata={"tag": "x"})
    assert [r["completion_id"] for r in page.items] == [old[7].completion_id] and not page.has_more
    assert reads.count == 10
