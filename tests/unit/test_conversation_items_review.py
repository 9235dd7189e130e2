"""Conversation item deletes (issue 39 item 6) under races and after a client's ``pop_item``, from an adversarial
review (pure logic: :class:`ConversationStore`'s statements run over dicts, each test fails on the reviewed code for
the reason in its docstring)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import pytest

from producers.gateway.conversations import ConversationService
from producers.gateway.pending_writes import PendingWrites
from runtime.settings import RedisSettings
from schemas.ids import input_item_id, output_item_id
from stream_processors.store.conversations import ConversationStore, Item, conversation_bytes, item_bytes
from tests.fakes.conversations import Redis, ask, planner
from tests.fakes.tenancy import api_key

pytestmark = pytest.mark.unit
CONVERSATION, ORG, TURN = "conv_" + "c" * 32, "org", "resp_" + "r" * 32
AT = datetime(2026, 11, 27, 12, tzinfo=UTC)
QUESTION = Item(input_item_id(TURN, 0), "user", "what is two and two?", AT, 0, TURN)
ANSWER = Item(output_item_id(TURN), "assistant", "four", AT, 1, TURN)
Row = dict[str, Any]


class MemoryStore(ConversationStore):
    """The store's own logic over its statements run on dicts (one conversation table, pointers, items, counts);
    ``before[name]`` (or ``before[name, value]``: one naming ``value``) runs once before the next such statement: a
    race, interleaved exactly."""

    def __init__(self) -> None:
        self.rows: dict[str, Row] = {}
        self.pointers: dict[tuple[str, str], Row] = {}
        self.items_: dict[tuple[Any, ...], Row] = {}
        self.used: dict[str, int] = {}
        self.shares: dict[str, int] = {}
        self.before: dict[str | tuple[str, str], Callable[[], Awaitable[object]]] = {}

    def start(self) -> None:
        self.rows[CONVERSATION] = {"conversation_id": CONVERSATION, "org_id": ORG, "created_at": AT, "metadata": {},
                                   "months": set(), "deleted_at": None}
        self._add(ORG, CONVERSATION, conversation_bytes({}))

    def _add(self, org_id: str, conversation_id: str, size: int) -> None:
        self.used[org_id] = self.used.get(org_id, 0) + size
        self.shares[conversation_id] = self.shares.get(conversation_id, 0) + size

    async def _run(self, name: str, params: Any) -> list[Row]:
        hook = self.before.pop(name, None) or next(
            (self.before.pop(k) for k in list(self.before) if isinstance(k, tuple) and k[0] == name and k[1] in params),
            None)
        if hook is not None:
            await hook()
        await asyncio.sleep(0)
        return self._execute(name, list(params))

    def _execute(self, name: str, p: list[Any]) -> list[Row]:
        if name == "row":
            return [dict(self.rows[p[0]])] if p[0] in self.rows else []
        if name == "add_months":
            row = self.rows.get(p[1])
            applied = row is not None and row["org_id"] == p[2] and row["deleted_at"] is None
            if applied and row is not None:
                row["months"] = set(row["months"]) | set(p[0])
            return [{"[applied]": applied}]
        if name == "pointers":
            return [dict(self.pointers[(p[0], i)]) for i in p[1] if (p[0], i) in self.pointers]
        if name == "put_pointer":
            kept = self.pointers.get((p[0], p[1]), {"deleted": None})
            self.pointers[(p[0], p[1])] = {"item_id": p[1], "created_at": p[2], "seq": p[3],
                                           "deleted": kept["deleted"]}
            return []
        if name == "bury_pointer":
            pointer = self.pointers.setdefault((p[0], p[1]), {"item_id": p[1], "created_at": None, "seq": None,
                                                              "deleted": None})
            applied = pointer["deleted"] is None
            pointer["deleted"] = True
            return [{"[applied]": applied}]
        if name == "put_item":
            self.items_[tuple(p[:5])] = dict(zip(("created_at", "seq", "item_id", "role", "text", "response_id",
                                                  "status"), p[2:], strict=True))
            return []
        if name == "item":
            return [dict(self.items_[tuple(p)])] if tuple(p) in self.items_ else []
        if name == "drop_item":
            self.items_.pop(tuple(p), None)
            return []
        if name in ("items_first", "items_last"):
            rows = sorted((r for k, r in self.items_.items() if k[:2] == (p[0], p[1])),
                          key=lambda r: (r["created_at"], r["seq"], r["item_id"]), reverse=name == "items_last")
            return [dict(r) for r in rows[:p[2]]]
        if name == "count_org":
            self.used[p[1]] = self.used.get(p[1], 0) + p[0]
            return []
        if name == "count_one":
            self.shares[p[1]] = self.shares.get(p[1], 0) + p[0]
            return []
        if name == "used":
            return [{"bytes": self.used[p[0]]}] if p[0] in self.used else []
        raise AssertionError(f"statement {name} is not faked")

    def listed(self) -> list[str]:
        return [r["item_id"] for k, r in sorted(self.items_.items(), key=lambda kv: kv[0][2:]) if k[0] == CONVERSATION]

    def kept(self) -> int:
        """What the conversation really keeps, as the store counts it."""
        return conversation_bytes({}) + sum(item_bytes(Item(r["item_id"], r["role"], r["text"], AT, 0))
                                            for r in self.items_.values())


async def answered_turn() -> MemoryStore:
    store = MemoryStore()
    store.start()
    assert await store.append(CONVERSATION, [QUESTION, ANSWER])
    return store


async def test_a_turn_redelivered_while_its_answer_is_deleted_does_not_bring_the_answer_back() -> None:
    """stream_processors/store/conversations.py ``_append``: the redelivery reads the pointers (the answer's not yet
    marked), the client's delete then marks it and drops the row, and the redelivery's ``put_item`` writes the row
    again: the deleted answer is listed, and in every later turn's history, with its storage already given back."""
    store = await answered_turn()
    store.before["put_pointer"] = lambda: store.delete_item(CONVERSATION, ORG, ANSWER.item_id)
    assert await store.append(CONVERSATION, [QUESTION, ANSWER])  # the writer, again after a crash
    assert store.listed() == [QUESTION.item_id]
    assert [i.item_id for i in await store.history(CONVERSATION, max_items=10)] == [QUESTION.item_id]
    assert store.used[ORG] == store.kept() == store.shares[CONVERSATION]


async def test_a_delete_between_a_turns_pointers_and_its_rows_neither_lists_the_item_nor_counts_it() -> None:
    """``delete_item`` read the item's row before the writer wrote it (its pointer is written first, and an answer's
    id is known to its client before the writer appends it): nothing was given back, the writer then wrote the row
    and counted it as new. The deleted answer stays listed, and counted after a retried delete drops it: the org's
    count above what it keeps, which the invariant forbids (it may err low, never high)."""
    store = MemoryStore()
    store.start()
    store.before["put_item", ANSWER.item_id] = lambda: store.delete_item(CONVERSATION, ORG, ANSWER.item_id)
    assert await store.append(CONVERSATION, [QUESTION, ANSWER])
    assert store.listed() == [QUESTION.item_id]
    assert store.used[ORG] <= store.kept() and store.shares[CONVERSATION] <= store.kept()


async def test_a_delete_that_began_before_a_turns_rows_were_written_gives_back_what_it_drops() -> None:
    """``delete_item`` read the row before it marked the pointer: a row the writer wrote in between (and counted as
    new, the mark not yet made) was dropped by the delete without being given back, the count above what is kept."""
    store = MemoryStore()
    store.start()
    at_mark, appended = asyncio.Event(), asyncio.Event()
    deleting: list[asyncio.Task[bool | None]] = []

    async def marking() -> None:
        at_mark.set()
        await appended.wait()

    async def racing() -> None:
        deleting.append(asyncio.create_task(store.delete_item(CONVERSATION, ORG, ANSWER.item_id)))
        await at_mark.wait()

    store.before["bury_pointer"] = marking
    store.before["put_item", ANSWER.item_id] = racing
    assert await store.append(CONVERSATION, [QUESTION, ANSWER])
    appended.set()
    assert await deleting[0]
    assert store.listed() == [QUESTION.item_id]
    assert store.used[ORG] == store.kept() == store.shares[CONVERSATION]


async def test_two_deletes_of_one_item_give_its_storage_back_once() -> None:
    store = await answered_turn()
    first, second = await asyncio.gather(store.delete_item(CONVERSATION, ORG, ANSWER.item_id),
                                         store.delete_item(CONVERSATION, ORG, ANSWER.item_id))
    assert sorted([first, second]) == [False, True]
    assert store.listed() == [QUESTION.item_id] and store.used[ORG] == store.kept()


async def test_the_next_turn_does_not_wait_for_a_previous_answer_its_client_deleted() -> None:
    """producers/gateway/turns.py ``_await_previous_turn``: the next turn waits until the previous turn's answer is
    readable (``get_item``), and a deleted item never is again: after the Agents SDK's ``pop_item`` of the answer
    (the last item), every turn of the conversation waited ``turn_wait_s`` (10 s) while the last-turn note lived."""
    store = await answered_turn()
    assert await store.delete_item(CONVERSATION, ORG, ANSWER.item_id)
    turns = planner(conversations=store, redis=Redis(last_turn=TURN), turn_wait_s=60.0)  # type: ignore[arg-type]
    async with asyncio.timeout(5):
        planned = await turns.plan(ask(conversation_id=CONVERSATION, org_id=ORG))
    assert "four" not in str(planned.messages) and "two and two" in str(planned.messages)


async def test_reads_after_a_client_deleted_the_last_answer_do_not_wait_for_it() -> None:
    """producers/gateway/conversations.py ``_written``: read-your-writes waits until the answered turn's answer is
    readable; once its client deleted it, each list, read or delete of the conversation waited ``read_wait_s`` (5 s)
    while the note lived (a minute)."""
    store = await answered_turn()
    assert await store.delete_item(CONVERSATION, ORG, ANSWER.item_id)
    redis = Redis(last_turn=TURN)  # answers every key: the pending-turn note names the turn
    pending = PendingWrites(redis, RedisSettings(), wait_s=60.0)  # type: ignore[arg-type]
    conversations = ConversationService(store, pending)
    async with asyncio.timeout(5):
        page = await conversations.items(CONVERSATION, api_key(org_id=ORG), after=None, limit=20, ascending=False)
    assert [item["id"] for item in page["data"]] == [QUESTION.item_id]

