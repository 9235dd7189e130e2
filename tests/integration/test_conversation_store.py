"""Conversations and stored responses in the real Cassandra: a delete answers 404 at once and the purge removes the
rows later, appends are idempotent, items read in turn order across turns and month partitions, cursors page, and
the first stored copy of a response wins."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import pytest_asyncio
from cassandra.cluster import Session
from typer.testing import CliRunner

from ops.cli import app as kns
from runtime.cassandra_client import connect_async, execute
from runtime.settings import Settings
from stream_processors.store.conversations import (
    APPEND_SLICE,
    CONVERSATION_BYTES,
    ITEM_BYTES,
    Conversation,
    ConversationNotFound,
    ConversationStore,
    Item,
)
from stream_processors.store.responses import ResponseStore, StoredResponse

pytestmark = pytest.mark.integration
JAN = datetime(2026, 1, 31, 23, 0, tzinfo=UTC)
FEB = datetime(2026, 2, 1, 1, 0, tzinfo=UTC)


@pytest_asyncio.fixture(loop_scope="session")
async def session(stack: Settings) -> AsyncIterator[Session]:
    cluster, session = await connect_async(stack.cassandra)
    yield session
    await asyncio.to_thread(cluster.shutdown)


@pytest_asyncio.fixture(loop_scope="session")
async def store(session: Session, stack: Settings) -> ConversationStore:
    return await ConversationStore.open(session, stack.cassandra.keyspace)


@pytest_asyncio.fixture(loop_scope="session")
async def responses(session: Session, stack: Settings) -> ResponseStore:
    return await ResponseStore.open(session, stack.cassandra.keyspace)


def uid(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"  # the test keyspace is shared: every test uses its own ids


def conversation(org: str, at: datetime | None = None, **metadata: str) -> Conversation:
    return Conversation(uid("conv"), org, at or datetime.now(UTC), metadata)


def turn(at: datetime, *texts: str, response_id: str | None = None) -> list[Item]:
    return [Item(uid("msg"), "user" if seq % 2 == 0 else "assistant", text, at, seq, response_id)
            for seq, text in enumerate(texts)]


def texts(items: list[Item]) -> list[str]:
    return [item.text for item in items]


async def test_create_get_update_delete(store: ConversationStore) -> None:
    org = uid("org")
    conv = conversation(org, topic="x")
    await store.create(conv, turn(conv.created_at, "hello"))

    got = await store.get(conv.conversation_id, org)
    assert got is not None and got.metadata == {"topic": "x"} and got.created_at.tzinfo == UTC
    assert abs(got.created_at - conv.created_at) < timedelta(milliseconds=1)
    assert await store.get(conv.conversation_id, uid("org")) is None

    updated = await store.update_metadata(conv.conversation_id, org, {"topic": "y", "n": "2"})
    assert updated is not None and updated.metadata == {"topic": "y", "n": "2"}
    assert await store.update_metadata(conv.conversation_id, uid("org"), {"a": "b"}) is None

    assert not await store.delete(conv.conversation_id, uid("org"))
    assert await store.delete(conv.conversation_id, org)
    assert await store.get(conv.conversation_id, org) is None  # 404 at once
    assert not await store.delete(conv.conversation_id, org)
    assert await store.update_metadata(conv.conversation_id, org, {"a": "b"}) is None
    assert (await store.list_owned(org, after=None, limit=10)).items == []
    with pytest.raises(ConversationNotFound):
        await store.items(conv.conversation_id, org, after=None, limit=10, ascending=True)
    assert await store.history(conv.conversation_id, max_items=10) == []


async def test_deleted_conversation_cannot_come_back(store: ConversationStore) -> None:
    org = uid("org")
    conv = conversation(org)
    items = turn(conv.created_at, "hi")
    await store.create(conv, items)
    await store.delete(conv.conversation_id, org)

    await store.create(conv, items)  # a redelivered create
    await store.append(conv.conversation_id, turn(FEB, "late"))
    assert await store.get(conv.conversation_id, org) is None
    assert await store.get_item(conv.conversation_id, org, items[0].item_id) is None

    unknown = uid("conv")
    await store.append(unknown, turn(FEB, "nobody"))
    assert await store.history(unknown, max_items=5) == []


async def test_append_is_idempotent_and_keeps_first_position(store: ConversationStore) -> None:
    org = uid("org")
    conv = conversation(org, JAN)
    await store.create(conv, [])
    first = turn(JAN, "q", "a", response_id="resp_1")
    await store.append(conv.conversation_id, first)
    await store.append(conv.conversation_id, first)
    # A redelivery with another time: the item stays where it was first written.
    await store.append(conv.conversation_id, [replace(first[0], created_at=FEB, seq=5)])

    page = await store.items(conv.conversation_id, org, after=None, limit=10, ascending=True)
    assert texts(page.items) == ["q", "a"] and not page.has_more
    assert [i.item_id for i in page.items] == [i.item_id for i in first]
    item = await store.get_item(conv.conversation_id, org, first[1].item_id)
    assert item is not None and item.role == "assistant" and item.response_id == "resp_1"
    assert item.created_at == JAN and item.seq == 1 and item.status == "completed"
    assert await store.get_item(conv.conversation_id, uid("org"), first[1].item_id) is None
    assert await store.get_item(conv.conversation_id, org, uid("msg")) is None


async def test_a_large_turn_is_written_whole(store: ConversationStore) -> None:
    conv = conversation(uid("org"))
    many = [str(n) for n in range(2 * APPEND_SLICE + 1)]
    await store.create(conv, turn(conv.created_at, "first"))
    await store.append(conv.conversation_id, turn(conv.created_at + timedelta(seconds=1), *many))
    assert texts(await store.history(conv.conversation_id, max_items=len(many))) == many


async def _three_turns(store: ConversationStore) -> tuple[str, Conversation]:
    """Turns in January (two) and February: two month partitions."""
    org = uid("org")
    conv = conversation(org, JAN)
    await store.create(conv, turn(JAN, "1", "2"))
    await store.append(conv.conversation_id, turn(JAN + timedelta(minutes=30), "3", "4"))
    await store.append(conv.conversation_id, turn(FEB, "5", "6", "7"))
    return org, conv


async def test_items_in_order_across_turns_and_months(store: ConversationStore) -> None:
    org, conv = await _three_turns(store)
    up = await store.items(conv.conversation_id, org, after=None, limit=100, ascending=True)
    assert texts(up.items) == ["1", "2", "3", "4", "5", "6", "7"] and not up.has_more
    down = await store.items(conv.conversation_id, org, after=None, limit=100, ascending=False)
    assert texts(down.items) == ["7", "6", "5", "4", "3", "2", "1"]
    assert all(item.created_at.tzinfo == UTC for item in up.items)


@pytest.mark.parametrize("ascending", [True, False])
async def test_items_pages_with_cursor(store: ConversationStore, ascending: bool) -> None:
    org, conv = await _three_turns(store)
    seen: list[str] = []
    after = None
    for _ in range(5):
        page = await store.items(conv.conversation_id, org, after=after, limit=3, ascending=ascending)
        seen += texts(page.items)
        if not page.has_more:
            break
        after = page.items[-1].item_id
    expected = ["1", "2", "3", "4", "5", "6", "7"]
    assert seen == (expected if ascending else expected[::-1])
    with pytest.raises(KeyError):
        await store.items(conv.conversation_id, org, after=uid("msg"), limit=3, ascending=ascending)


async def test_item_of_another_conversation_is_a_bad_cursor(store: ConversationStore) -> None:
    org, conv = await _three_turns(store)
    other = conversation(org)
    items = turn(other.created_at, "x")
    await store.create(other, items)
    with pytest.raises(KeyError):
        await store.items(conv.conversation_id, org, after=items[0].item_id, limit=3, ascending=True)
    with pytest.raises(ConversationNotFound):
        await store.items(conv.conversation_id, uid("org"), after=None, limit=3, ascending=True)


async def test_history_is_the_newest_oldest_first(store: ConversationStore) -> None:
    _, conv = await _three_turns(store)
    assert texts(await store.history(conv.conversation_id, max_items=4)) == ["4", "5", "6", "7"]
    assert texts(await store.history(conv.conversation_id, max_items=2)) == ["6", "7"]
    assert len(await store.history(conv.conversation_id, max_items=100)) == 7
    assert await store.history(conv.conversation_id, max_items=0) == []


async def test_list_owned_newest_first_with_cursor(store: ConversationStore) -> None:
    org = uid("org")
    times = [JAN - timedelta(days=70), JAN, JAN + timedelta(hours=1), FEB]  # three months, one skipped
    convs = [conversation(org, at, n=str(n)) for n, at in enumerate(times)]
    for conv in convs:
        await store.create(conv, [])
    await store.create(conversation(uid("org")), [])  # another org's
    newest_first = [c.conversation_id for c in reversed(convs)]

    page = await store.list_owned(org, after=None, limit=10)
    assert [c.conversation_id for c in page.items] == newest_first and not page.has_more
    seen, after = [], None
    while True:
        page = await store.list_owned(org, after=after, limit=3 if after is None else 1)
        seen += [c.conversation_id for c in page.items]
        if not page.has_more:
            break
        after = page.items[-1].conversation_id
    assert seen == newest_first

    await store.delete(convs[2].conversation_id, org)
    page = await store.list_owned(org, after=convs[3].conversation_id, limit=2)
    assert [c.conversation_id for c in page.items] == [convs[1].conversation_id, convs[0].conversation_id]
    for bad in (convs[2].conversation_id, uid("conv")):
        with pytest.raises(KeyError):
            await store.list_owned(org, after=bad, limit=2)


async def _leftovers(session: Session, keyspace: str, conversation_id: str) -> dict[str, int]:
    """Rows of a conversation of JAN and FEB deleted today, per table."""
    by_conversation = {"conversations": "", "conversation_items": " AND month IN ('2026-01', '2026-02')",
                       "conversation_items_by_id": ""}
    counts = {table: len(await execute(session, f"SELECT * FROM {keyspace}.{table} WHERE conversation_id = %s"
                                                f"{where}", [conversation_id]))
              for table, where in by_conversation.items()}
    marks = await execute(session, f"SELECT conversation_id FROM {keyspace}.conversations_deleted WHERE day = %s",
                          [datetime.now(UTC).strftime("%Y-%m-%d")])
    counts["conversations_deleted"] = sum(r["conversation_id"] == conversation_id for r in marks)
    return counts


async def test_purge_removes_deleted_conversations_after_retention(store: ConversationStore, session: Session,
                                                                   stack: Settings) -> None:
    ks = stack.cassandra.keyspace
    org = uid("org")
    gone, live = conversation(org, JAN), conversation(org, JAN)
    for conv in (gone, live):
        await store.create(conv, turn(JAN, "a", "b"))
        await store.append(conv.conversation_id, turn(FEB, "c"))
    await store.delete(gone.conversation_id, org)

    await store.purge()  # within the retention period: kept
    kept = {"conversations": 1, "conversation_items": 3, "conversation_items_by_id": 3, "conversations_deleted": 1}
    assert await _leftovers(session, ks, gone.conversation_id) == kept

    later = datetime.now(UTC) + timedelta(days=31)
    assert await store.purge(now=later) >= 1
    assert set((await _leftovers(session, ks, gone.conversation_id)).values()) == {0}
    await store.purge(now=later)  # idempotent
    assert await store.get(gone.conversation_id, org) is None
    assert texts(await store.history(live.conversation_id, max_items=10)) == ["a", "b", "c"]
    assert [c.conversation_id for c in (await store.list_owned(org, after=None, limit=5)).items] == [
        live.conversation_id]


async def test_an_orgs_storage_counts_what_its_conversations_keep(store: ConversationStore) -> None:
    """Issue 37 H3: a conversation's row and metadata, each of its items once (a redelivered turn is not counted
    again), a metadata update's difference; another org's count is its own."""
    org, other = uid("org"), uid("org")
    conv = conversation(org, topic="x")
    first = turn(conv.created_at, "hello", "héllo")  # bytes, not characters
    await store.create(conv, first)
    created = CONVERSATION_BYTES + len("topic") + len("x") + 2 * ITEM_BYTES + len("hello") + len("héllo".encode())
    assert await store.storage_used(org) == created

    await store.append(conv.conversation_id, first)  # the writer's redelivery
    assert await store.storage_used(org) == created
    await store.append(conv.conversation_id, turn(datetime.now(UTC), "more"))
    assert await store.storage_used(org) == created + ITEM_BYTES + len("more")

    await store.update_metadata(conv.conversation_id, org, {"topic": "xyz", "n": "1"})
    assert await store.storage_used(org) == created + ITEM_BYTES + len("more") + len("yz") + len("n1")
    assert await store.storage_used(other) == 0


async def test_the_purge_gives_a_deleted_conversations_storage_back(store: ConversationStore) -> None:
    org = uid("org")
    gone, live = conversation(org), conversation(org)
    for conv in (gone, live):
        await store.create(conv, turn(conv.created_at, "a" * 100))
    both = await store.storage_used(org)
    assert both == 2 * (CONVERSATION_BYTES + ITEM_BYTES + 100)

    await store.delete(gone.conversation_id, org)
    assert await store.storage_used(org) == both, "a deleted conversation keeps its rows until it is purged"
    later = datetime.now(UTC) + timedelta(days=31)
    await store.purge(now=later)
    assert await store.storage_used(org) == both // 2
    await store.purge(now=later)  # nothing given back twice
    assert await store.storage_used(org) == both // 2


async def test_a_deleted_item_is_gone_from_every_read_and_gives_its_storage_back(store: ConversationStore) -> None:
    org = uid("org")
    conv = conversation(org)
    first = turn(conv.created_at, "question", "answer")
    await store.create(conv, first)
    before = await store.storage_used(org)

    assert await store.delete_item(conv.conversation_id, org, first[0].item_id) is True
    assert await store.get_item(conv.conversation_id, org, first[0].item_id) is None
    page = await store.items(conv.conversation_id, org, after=None, limit=10, ascending=True)
    assert texts(page.items) == ["answer"]
    assert texts(await store.history(conv.conversation_id, max_items=10)) == ["answer"]
    assert await store.storage_used(org) == before - ITEM_BYTES - len("question")
    with pytest.raises(KeyError):  # no longer a cursor
        await store.items(conv.conversation_id, org, after=first[0].item_id, limit=10, ascending=True)

    assert await store.delete_item(conv.conversation_id, org, first[0].item_id) is False  # once
    assert await store.delete_item(conv.conversation_id, org, uid("msg")) is False
    assert await store.delete_item(conv.conversation_id, uid("org"), first[1].item_id) is None  # not its org's
    assert await store.storage_used(org) == before - ITEM_BYTES - len("question")


async def test_a_redelivered_turn_does_not_bring_a_deleted_item_back(store: ConversationStore) -> None:
    org = uid("org")
    conv = conversation(org)
    await store.create(conv, [])
    answered = turn(conv.created_at, "q", "a")
    await store.append(conv.conversation_id, answered)
    await store.delete_item(conv.conversation_id, org, answered[1].item_id)
    used = await store.storage_used(org)

    assert await store.append(conv.conversation_id, answered)  # the writer's redelivery after a crash
    page = await store.items(conv.conversation_id, org, after=None, limit=10, ascending=True)
    assert texts(page.items) == ["q"]
    assert await store.storage_used(org) == used


@pytest.mark.parametrize("redelivered", [False, True])
async def test_an_append_racing_an_item_delete_neither_brings_it_back_nor_counts_it(
        store: ConversationStore, monkeypatch: pytest.MonkeyPatch, redelivered: bool) -> None:
    """The delete lands between the writer's pointers and its rows (a client knows an answer's id before the
    writer appends it), on the first append or on a redelivery after a crash."""
    org = uid("org")
    conv = conversation(org)
    await store.create(conv, [])
    question, answer = turn(conv.created_at, "q" * 10, "a" * 100)
    if redelivered:
        await store.append(conv.conversation_id, [question, answer])
    run = store._run
    raced = False

    async def deleting_before_the_answers_row(name: str, params: Any) -> Any:
        nonlocal raced
        if name == "put_item" and answer.item_id in params and not raced:
            raced = True
            await store.delete_item(conv.conversation_id, org, answer.item_id)
        return await run(name, params)

    monkeypatch.setattr(store, "_run", deleting_before_the_answers_row)
    await store.append(conv.conversation_id, [question, answer])
    monkeypatch.setattr(store, "_run", run)
    assert raced
    page = await store.items(conv.conversation_id, org, after=None, limit=10, ascending=True)
    assert texts(page.items) == ["q" * 10]
    assert texts(await store.history(conv.conversation_id, max_items=10)) == ["q" * 10]
    assert await store.get_item(conv.conversation_id, org, answer.item_id) is None
    assert await store.storage_used(org) == CONVERSATION_BYTES + ITEM_BYTES + 10  # what is kept, exactly


async def test_two_deletes_of_one_item_at_once_give_its_storage_back_once(store: ConversationStore) -> None:
    org = uid("org")
    conv = conversation(org)
    items = turn(conv.created_at, "x" * 1000)
    await store.create(conv, items)
    used = await store.storage_used(org)
    results = await asyncio.gather(*(store.delete_item(conv.conversation_id, org, items[0].item_id)
                                     for _ in range(4)))
    assert sorted(results) == [False, False, False, True]
    assert await store.storage_used(org) == used - ITEM_BYTES - 1000


async def test_items_cannot_be_added_to_a_deleted_conversation(store: ConversationStore) -> None:
    org = uid("org")
    conv = conversation(org)
    await store.create(conv, [])
    assert await store.append(conv.conversation_id, turn(conv.created_at, "kept"))
    await store.delete(conv.conversation_id, org)
    assert not await store.append(conv.conversation_id, turn(conv.created_at, "too late"))


def test_purge_cli(stack: Settings) -> None:
    result = CliRunner().invoke(kns, ["conversations", "purge", "--after-days", "30"])
    assert result.exit_code == 0, result.output
    assert "purged" in result.output


def response(org: str, **fields: object) -> StoredResponse:
    values: dict[str, object] = dict(
        response_id=uid("resp"), org_id=org, key_id="key_1", user="u1", model="smollm2", created_at=JAN,
        status="completed", input_items=[{"role": "user", "content": "hi"}], output_text="hello",
        prompt_tokens=3, completion_tokens=2, cached_tokens=0)
    return StoredResponse(**{**values, **fields})  # type: ignore[arg-type]


async def test_stored_response_first_wins_and_delete(responses: ResponseStore) -> None:
    org = uid("org")
    first = response(org, metadata={"k": "v"}, conversation_id="conv_1", temperature=0.5, background=True,
                     completed_at=FEB, max_output_tokens=16, incomplete_reason="max_output_tokens",
                     status="incomplete", truncated_items=2)
    assert await responses.write(first)
    assert not await responses.write(replace(first, output_text="another copy"))
    assert await responses.get(first.response_id, org) == first
    assert await responses.get(first.response_id, uid("org")) is None

    minimal = response(org, user=None)
    assert await responses.write(minimal)
    assert await responses.get(minimal.response_id, org) == minimal

    assert not await responses.delete(first.response_id, uid("org"))
    assert await responses.delete(first.response_id, org)
    assert await responses.get(first.response_id, org) is None
    assert not await responses.delete(first.response_id, org)
    assert not await responses.write(first)  # a redelivery after the delete
    assert await responses.get(first.response_id, org) is None
    assert not await responses.delete(uid("resp"), org)
