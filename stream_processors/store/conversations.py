"""Conversations and their items in Cassandra: created and read by the gateways, appended to by the writer.

Tables (``infra/local/cassandra/schema.cql``): ``conversations`` (the record of truth, with the months its items
span), ``conversation_items`` (one partition per conversation and month, in turn order), ``conversation_items_by_id``
(where an item is), ``conversations_by_owner`` + ``conversation_owner_months`` (an org's listing, newest first)
and ``conversations_deleted`` (what the purge job scans). Every statement runs at LOCAL_QUORUM.

Every write to a conversation row is conditional: the first create wins, and an append or a metadata update only
applies to a live conversation of its org, so nothing brings back a deleted conversation or recreates a purged
one. A delete marks the row (every read answers 404 at once) and the purge removes its rows after
:data:`PURGE_AFTER_S`. Writes that span tables are ordered so that a crash between two of them leaves nothing a
reader trusts: index rows are checked against the conversation row, and a retry finishes the work.

Storage is counted per org (``conversation_storage``: what :func:`conversation_bytes` and :func:`item_bytes` say a
conversation and an item take) for the org's quota, which the gateway checks before a create or a metadata update.
A write is counted once it is made, and the purge gives a conversation's share back before it forgets it; a process
dying in between leaves the count lower by that one write, never higher (a quota must not refuse what is not
stored). A deleted conversation counts until it is purged: its rows are kept until then.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any, Generic, TypeVar

from cassandra.cluster import Session

from runtime.cassandra_client import execute, prepare
from stream_processors.store.completions import month_of

#: a deleted conversation's rows are purged this long after its delete
PURGE_AFTER_S = 30 * 24 * 3600
#: how many days before the purge cutoff the purge looks for deletions: a purge job stopped for longer than this
#: leaves the deletions older than that unpurged (still unreadable)
PURGE_LOOKBACK_DAYS = 400
#: an append writes its items in slices of this many: one call's concurrent writes stay bounded however many items a
#: turn adds (the API takes up to 256 input items per response, 20 per conversation created)
APPEND_SLICE = 64
#: what a conversation takes of its org's storage quota beside its metadata and items (its row, its owner's index
#: rows): Cassandra's own overhead, before replication, roughly
CONVERSATION_BYTES = 512
#: and each item beside its text (its row's keys, its pointer)
ITEM_BYTES = 128

Row = dict[str, Any]
T = TypeVar("T")

_ITEM = "created_at, seq, item_id, role, text, response_id, status"
_ITEMS = "SELECT " + _ITEM + " FROM {ks}.conversation_items WHERE conversation_id = ? AND month = ?"
_DESC = "ORDER BY created_at DESC, seq DESC, item_id DESC"
_OWNED = "SELECT created_at, conversation_id FROM {ks}.conversations_by_owner WHERE org_id = ? AND month = ?"
_LIVE_OF = "IF org_id = ? AND deleted_at = null"
_CQL = {
    "create": "INSERT INTO {ks}.conversations (conversation_id, org_id, created_at, metadata, months) "
              "VALUES (?, ?, ?, ?, ?) IF NOT EXISTS",
    "row": "SELECT conversation_id, org_id, created_at, metadata, months, deleted_at FROM {ks}.conversations "
           "WHERE conversation_id = ?",
    "set_metadata": "UPDATE {ks}.conversations SET metadata = ? WHERE conversation_id = ? " + _LIVE_OF,
    "add_months": "UPDATE {ks}.conversations SET months = months + ? WHERE conversation_id = ? " + _LIVE_OF,
    "mark_deleted": "UPDATE {ks}.conversations SET deleted_at = ? WHERE conversation_id = ? " + _LIVE_OF,
    "drop": "DELETE FROM {ks}.conversations WHERE conversation_id = ? IF EXISTS",
    "own": "INSERT INTO {ks}.conversations_by_owner (org_id, month, created_at, conversation_id) VALUES (?, ?, ?, ?)",
    "disown": "DELETE FROM {ks}.conversations_by_owner WHERE org_id = ? AND month = ? AND created_at = ? "
              "AND conversation_id = ?",
    "own_month": "INSERT INTO {ks}.conversation_owner_months (org_id, month) VALUES (?, ?)",
    "owner_months": "SELECT month FROM {ks}.conversation_owner_months WHERE org_id = ?",
    "owned_newest": _OWNED + " LIMIT ?",
    "owned_older": _OWNED + " AND (created_at, conversation_id) < (?, ?) LIMIT ?",
    "put_pointer": "INSERT INTO {ks}.conversation_items_by_id (conversation_id, item_id, created_at, seq) "
                   "VALUES (?, ?, ?, ?)",
    "pointers": "SELECT item_id, created_at, seq, deleted FROM {ks}.conversation_items_by_id "
                "WHERE conversation_id = ? AND item_id IN ?",
    "bury_pointer": "UPDATE {ks}.conversation_items_by_id SET deleted = true WHERE conversation_id = ? "
                    "AND item_id = ? IF deleted = null",
    "drop_item": "DELETE FROM {ks}.conversation_items WHERE conversation_id = ? AND month = ? AND created_at = ? "
                 "AND seq = ? AND item_id = ?",
    "drop_pointers": "DELETE FROM {ks}.conversation_items_by_id WHERE conversation_id = ?",
    "put_item": "INSERT INTO {ks}.conversation_items (conversation_id, month, " + _ITEM + ") "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
    "item": _ITEMS + " AND created_at = ? AND seq = ? AND item_id = ?",
    "items_first": _ITEMS + " LIMIT ?",
    "items_after": _ITEMS + " AND (created_at, seq, item_id) > (?, ?, ?) LIMIT ?",
    "items_last": _ITEMS + f" {_DESC} LIMIT ?",
    "items_before": _ITEMS + f" AND (created_at, seq, item_id) < (?, ?, ?) {_DESC} LIMIT ?",
    "drop_items": "DELETE FROM {ks}.conversation_items WHERE conversation_id = ? AND month = ?",
    "mark_day": "INSERT INTO {ks}.conversations_deleted (day, deleted_at, conversation_id) VALUES (?, ?, ?)",
    "marked_on": "SELECT deleted_at, conversation_id FROM {ks}.conversations_deleted WHERE day = ? "
                 "AND deleted_at <= ?",
    "unmark_day": "DELETE FROM {ks}.conversations_deleted WHERE day = ? AND deleted_at = ? AND conversation_id = ?",
    "used": "SELECT bytes FROM {ks}.conversation_storage WHERE org_id = ?",
    "count_org": "UPDATE {ks}.conversation_storage SET bytes = bytes + ? WHERE org_id = ?",
    "count_one": "UPDATE {ks}.conversation_storage_by_conversation SET bytes = bytes + ? WHERE conversation_id = ?",
    "counted": "SELECT bytes FROM {ks}.conversation_storage_by_conversation WHERE conversation_id = ?",
    "forget_count": "DELETE FROM {ks}.conversation_storage_by_conversation WHERE conversation_id = ?",
}

Cursor = tuple[datetime, int, str]  # an item's clustering key: (created_at, seq, item_id)


class ConversationNotFound(LookupError):
    """The conversation is unknown, another org's or deleted (the API answers 404)."""


@dataclass(frozen=True)
class Conversation:
    conversation_id: str
    org_id: str
    created_at: datetime
    metadata: dict[str, str]


@dataclass(frozen=True)
class Item:
    item_id: str
    role: str
    text: str
    #: the turn's time: items of one turn share it
    created_at: datetime
    #: position within its turn
    seq: int
    #: the response (request id) that produced or consumed it
    response_id: str | None = None
    status: str = "completed"


@dataclass(frozen=True)
class Page(Generic[T]):
    items: list[T]
    has_more: bool


class ConversationStore:
    def __init__(self, session: Session, keyspace: str) -> None:
        self._session = session

        self._cql = {name: prepare(session, query.format(ks=keyspace)) for name, query in _CQL.items()}

    @classmethod
    async def open(cls, session: Session, keyspace: str) -> ConversationStore:
        return await asyncio.to_thread(cls, session, keyspace)

    async def _run(self, name: str, params: Sequence[Any]) -> list[Row]:
        return await execute(self._session, self._cql[name], params)

    # --- conversations (the gateways) ----------------------------------------------------------------------

    async def create(self, conversation: Conversation, items: list[Item]) -> None:
        """The conversation, its owner's index rows and its initial items; idempotent."""
        c = conversation
        months = {month_of(item.created_at) for item in items}
        result = (await self._run("create", [c.conversation_id, c.org_id, c.created_at, c.metadata, months]))[0]
        if not result["[applied]"] and (result.get("org_id") != c.org_id or result.get("deleted_at") is not None):
            return  # another org's id, or deleted since: a redelivered create must not bring it back
        month = month_of(c.created_at)
        await asyncio.gather(self._run("own_month", [c.org_id, month]),
                             self._run("own", [c.org_id, month, c.created_at, c.conversation_id]))
        if result["[applied]"]:
            await self._count(c.org_id, c.conversation_id, conversation_bytes(c.metadata))
        await self.append(c.conversation_id, items)

    async def get(self, conversation_id: str, org_id: str) -> Conversation | None:
        """An org's live conversation; None when unknown, another org's or deleted."""
        row = await self._live(conversation_id, org_id)
        return None if row is None else _conversation(row)

    async def update_metadata(self, conversation_id: str, org_id: str,
                              metadata: dict[str, str]) -> Conversation | None:
        """Replace the metadata; None as :meth:`get`."""
        row = await self._live(conversation_id, org_id)
        if row is None:
            return None
        result = await self._run("set_metadata", [metadata, conversation_id, org_id])
        if not result[0]["[applied]"]:
            return None
        await self._count(org_id, conversation_id,
                          conversation_bytes(metadata) - conversation_bytes(dict(row["metadata"] or {})))
        return replace(_conversation(row), metadata=dict(metadata))

    async def storage_used(self, org_id: str) -> int:
        """What the org's conversations take, deleted ones included until they are purged (bytes, as counted)."""
        rows = await self._run("used", [org_id])
        return max(0, int(rows[0]["bytes"] or 0)) if rows else 0

    async def _count(self, org_id: str, conversation_id: str, size: int) -> None:
        if size:
            await asyncio.gather(self._run("count_org", [size, org_id]),
                                 self._run("count_one", [size, conversation_id]))

    async def delete(self, conversation_id: str, org_id: str) -> bool:
        row = await self._live(conversation_id, org_id)
        if row is None:
            return False
        at = datetime.now(UTC)
        # The purge's mark first: a crash after the delete below must not leave a deleted conversation unpurged.
        await self._run("mark_day", [_day_of(at), at, conversation_id])
        result = await self._run("mark_deleted", [at, conversation_id, org_id])
        if not result[0]["[applied]"]:
            return False  # a concurrent delete won
        await self._disown(row)
        return True

    async def list_owned(self, org_id: str, *, after: str | None, limit: int) -> Page[Conversation]:
        """An org's conversations, newest first, after the conversation ``after`` (one of the org's live
        conversations, else ``KeyError``)."""
        cursor = None
        if after is not None:
            row = await self._live(after, org_id)
            if row is None:
                raise KeyError(after)
            cursor = (row["created_at"], after)
        found: list[Conversation] = []
        for month in await self._owner_months(org_id, cursor):
            found += await self._owned(org_id, month, cursor, want=limit + 1 - len(found))
            if len(found) > limit:
                break
        return Page(found[:limit], len(found) > limit)

    async def _owner_months(self, org_id: str, cursor: tuple[datetime, str] | None) -> list[str]:
        rows = await self._run("owner_months", [org_id])
        last = None if cursor is None else month_of(_aware(cursor[0]))
        return [r["month"] for r in rows if last is None or r["month"] <= last]

    async def _owned(self, org_id: str, month: str, cursor: tuple[datetime, str] | None, *,
                     want: int) -> list[Conversation]:
        """Up to ``want`` live conversations of one index month, older than ``cursor``. A cursor of a newer month
        leaves this month whole."""
        found: list[Conversation] = []
        while len(found) < want:
            batch = want - len(found)
            index = await (self._run("owned_newest", [org_id, month, batch]) if cursor is None else
                           self._run("owned_older", [org_id, month, *cursor, batch]))
            rows = await asyncio.gather(*(self._live(r["conversation_id"], org_id) for r in index))
            found += [_conversation(row) for row in rows if row is not None]
            if len(index) < batch:
                break
            cursor = (index[-1]["created_at"], index[-1]["conversation_id"])
        return found

    # --- items -----------------------------------------------------------------------------------------

    async def append(self, conversation_id: str, items: list[Item]) -> bool:
        """Add one turn's items (the writer, or a client's items create); an upsert by item id: a redelivery
        rewrites the same rows, an item keeps the position of its first write, and a deleted item stays deleted.
        Nothing is written to a deleted or unknown conversation (False)."""
        row = await self._row(conversation_id)
        if row is None or row["deleted_at"] is not None:
            return False
        months = set(row["months"] or ())
        for start in range(0, len(items), APPEND_SLICE):
            if not await self._append(conversation_id, row["org_id"], items[start:start + APPEND_SLICE],
                                      months):
                return False
        return True

    async def delete_item(self, conversation_id: str, org_id: str, item_id: str) -> bool | None:
        """Delete one item of an org's live conversation (None when :meth:`get` would be None; False: no such
        item, or deleted already). Its pointer is marked first, so that one delete of two at once gives its storage
        back and a redelivered turn never writes it again; a crash before its row is gone leaves the row listed
        until the delete is retried (which finishes it and answers 404), and one before the storage is given
        back counts it until the conversation is purged."""
        if await self._live(conversation_id, org_id) is None:
            return None
        pointers = await self._run("pointers", [conversation_id, [item_id]])
        if not pointers:
            return False
        at, seq = _aware(pointers[0]["created_at"]), pointers[0]["seq"]
        key = [conversation_id, month_of(at), at, seq, item_id]
        if pointers[0]["deleted"]:
            await self._run("drop_item", key)  # a delete that crashed half-way, finished
            return False
        buried = await self._run("bury_pointer", [conversation_id, item_id])
        if not buried[0]["[applied]"]:
            return False  # a concurrent delete won
        # The row read after the mark: an append that wrote it before then counted it, and one after does not.
        rows = await self._run("item", key)
        if rows:
            await self._count(org_id, conversation_id, -item_bytes(_item(rows[0])))
        await self._run("drop_item", key)
        return True

    async def _append(self, conversation_id: str, org_id: str, items: list[Item], months: set[str]) -> bool:
        """False: the conversation was deleted (or purged) since it was read."""
        placed, new = await self._placed(conversation_id, items)
        new_months = {month_of(item.created_at) for item in placed} - months
        if new_months:
            result = await self._run("add_months", [new_months, conversation_id, org_id])
            if not result[0]["[applied]"]:
                return False
            months |= new_months
        # Pointers first: every item a listing shows can then be its cursor.
        await asyncio.gather(*(self._run("put_pointer", [conversation_id, i.item_id, i.created_at, i.seq])
                               for i in placed))
        await asyncio.gather(*(self._run("put_item", [conversation_id, month_of(i.created_at), i.created_at, i.seq,
                                                      i.item_id, i.role, i.text, i.response_id, i.status])
                               for i in placed))
        # An item whose delete marked its pointer meanwhile (after the pointers were read) loses the row this
        # append wrote again, and is not counted: its delete reads the row after its mark, and gives back only
        # what it finds then.
        buried = await self._buried(conversation_id, [i.item_id for i in placed])
        await asyncio.gather(*(self._run("drop_item", [conversation_id, month_of(i.created_at), i.created_at, i.seq,
                                                       i.item_id]) for i in placed if i.item_id in buried))
        # Counted once made, and only the items new to the conversation: a redelivered turn rewrites its rows
        await self._count(org_id, conversation_id,
                          sum(item_bytes(i) for i in placed if i.item_id in new and i.item_id not in buried))
        return True

    async def _buried(self, conversation_id: str, item_ids: list[str]) -> set[str]:
        rows = await self._run("pointers", [conversation_id, item_ids]) if item_ids else []
        return {r["item_id"] for r in rows if r["deleted"]}

    async def _placed(self, conversation_id: str, items: list[Item]) -> tuple[list[Item], set[str]]:
        """The items at the positions they were first written at (their own for new ones), and the ids of the new;
        an item deleted since is left out."""
        rows = await self._run("pointers", [conversation_id, [item.item_id for item in items]])
        first = {r["item_id"]: (_aware(r["created_at"]), r["seq"]) for r in rows}
        deleted = {r["item_id"] for r in rows if r["deleted"]}
        placed = [replace(i, created_at=first[i.item_id][0], seq=first[i.item_id][1]) if i.item_id in first else i
                  for i in items if i.item_id not in deleted]
        return placed, {i.item_id for i in items if i.item_id not in first}

    async def items(self, conversation_id: str, org_id: str, *, after: str | None, limit: int,
                    ascending: bool) -> Page[Item]:
        """A conversation's items in turn order (or reversed), after the item ``after`` (one of its items, else
        ``KeyError``). :class:`ConversationNotFound` when :meth:`get` would be None."""
        row = await self._live(conversation_id, org_id)
        if row is None:
            raise ConversationNotFound(conversation_id)
        cursor = None if after is None else await self._cursor(conversation_id, after)
        found = await self._scan(conversation_id, _months(row, cursor, ascending), cursor, ascending,
                                 want=limit + 1)
        return Page(found[:limit], len(found) > limit)

    async def get_item(self, conversation_id: str, org_id: str, item_id: str) -> Item | None:
        if await self._live(conversation_id, org_id) is None:
            return None
        pointers = await self._run("pointers", [conversation_id, [item_id]])
        if not pointers or pointers[0]["deleted"]:
            return None
        at = _aware(pointers[0]["created_at"])
        rows = await self._run("item", [conversation_id, month_of(at), at, pointers[0]["seq"], item_id])
        return _item(rows[0]) if rows else None

    async def written(self, conversation_id: str, org_id: str, item_id: str) -> bool:
        """Whether the item of an org's live conversation was appended: readable, or deleted since (a reader
        waiting for a turn's answer must not wait for one its client deleted)."""
        if await self._live(conversation_id, org_id) is None:
            return False
        pointers = await self._run("pointers", [conversation_id, [item_id]])
        if not pointers:
            return False
        if pointers[0]["deleted"]:
            return True
        at = _aware(pointers[0]["created_at"])
        return bool(await self._run("item", [conversation_id, month_of(at), at, pointers[0]["seq"], item_id]))

    async def history(self, conversation_id: str, *, max_items: int) -> list[Item]:
        """The newest ``max_items`` items of a live conversation, oldest first (a turn's prompt)."""
        row = await self._row(conversation_id)
        if row is None or row["deleted_at"] is not None or max_items <= 0:
            return []
        newest = await self._scan(conversation_id, _months(row, None, False), None, False, want=max_items)
        return newest[::-1]

    async def _cursor(self, conversation_id: str, item_id: str) -> Cursor:
        rows = await self._run("pointers", [conversation_id, [item_id]])
        if not rows or rows[0]["deleted"]:
            raise KeyError(item_id)
        return _aware(rows[0]["created_at"]), rows[0]["seq"], item_id

    async def _scan(self, conversation_id: str, months: list[str], cursor: Cursor | None, ascending: bool, *,
                    want: int) -> list[Item]:
        """Up to ``want`` items from the month partitions in order. A cursor in another month leaves a month's
        slice whole (a later month ascending) or empty."""
        found: list[Item] = []
        for month in months:
            params: list[Any]
            if cursor is None:
                name, params = ("items_first" if ascending else "items_last"), [conversation_id, month]
            else:
                name, params = ("items_after" if ascending else "items_before"), [conversation_id, month, *cursor]
            found += [_item(row) for row in await self._run(name, [*params, want - len(found)])]
            if len(found) >= want:
                break
        return found

    # --- purge (the purge job) -------------------------------------------------------------------------

    async def purge(self, *, now: datetime | None = None, after_s: float = PURGE_AFTER_S) -> int:
        """Remove every row of the conversations deleted more than ``after_s`` before ``now``; idempotent (a purge
        that crashed is finished by the next). Returns how many conversations were purged."""
        cutoff = (now or datetime.now(UTC)) - timedelta(seconds=after_s)
        days = [_day_of(cutoff - timedelta(days=back)) for back in range(PURGE_LOOKBACK_DAYS + 1)]
        marked = await asyncio.gather(*(self._run("marked_on", [day, cutoff]) for day in days))
        purged = 0
        for day, rows in zip(days, marked, strict=True):
            for mark in rows:
                purged += await self._purge_one(day, mark, cutoff)
        return purged

    async def _purge_one(self, day: str, mark: Row, cutoff: datetime) -> bool:
        row = await self._row(mark["conversation_id"])
        deleted_at = None if row is None else row["deleted_at"]
        if deleted_at is not None and _aware(deleted_at) > cutoff:
            return False  # the mark of a delete that lost a race: the winner's own mark purges it in time
        if row is not None and deleted_at is not None:
            await self._drop(row)
        # Last: a crash before this line leaves the mark, and the next purge finishes the job.
        await self._run("unmark_day", [day, mark["deleted_at"], mark["conversation_id"]])
        return deleted_at is not None

    async def _drop(self, row: Row) -> None:
        conversation_id = row["conversation_id"]
        await asyncio.gather(*(self._run("drop_items", [conversation_id, month]) for month in row["months"] or ()),
                             self._run("drop_pointers", [conversation_id]), self._disown(row))
        await self._release(row["org_id"], conversation_id)
        # The conversation row goes after its items: a retry still knows their months.
        await self._run("drop", [conversation_id])

    async def _release(self, org_id: str, conversation_id: str) -> None:
        """The conversation's share of its org's storage, given back; its own count forgotten after (a retry
        after a crash in between gives it back twice: the count errs low)."""
        rows = await self._run("counted", [conversation_id])
        share = int(rows[0]["bytes"] or 0) if rows else 0
        if share:
            await self._run("count_org", [-share, org_id])
        await self._run("forget_count", [conversation_id])

    # --- rows ------------------------------------------------------------------------------------------

    async def _row(self, conversation_id: str) -> Row | None:
        rows = await self._run("row", [conversation_id])
        return rows[0] if rows else None

    async def _live(self, conversation_id: str, org_id: str) -> Row | None:
        row = await self._row(conversation_id)
        if row is None or row["org_id"] != org_id or row["deleted_at"] is not None:
            return None
        return row

    async def _disown(self, row: Row) -> None:
        created_at = _aware(row["created_at"])
        await self._run("disown", [row["org_id"], month_of(created_at), created_at, row["conversation_id"]])


def _months(row: Row, cursor: Cursor | None, ascending: bool) -> list[str]:
    """The item months to visit in reading order, from the cursor's month on."""
    months: Iterable[str] = sorted(row["months"] or (), reverse=not ascending)
    if cursor is not None:
        start = month_of(cursor[0])
        months = (m for m in months if (m >= start if ascending else m <= start))
    return list(months)


def _aware(at: datetime) -> datetime:
    """Cassandra hands out naive UTC datetimes."""
    return at.replace(tzinfo=UTC)


def _day_of(at: datetime) -> str:
    return at.astimezone(UTC).strftime("%Y-%m-%d")


def _conversation(row: Row) -> Conversation:
    return Conversation(row["conversation_id"], row["org_id"], _aware(row["created_at"]), dict(row["metadata"] or {}))


def _item(row: Row) -> Item:
    return Item(row["item_id"], row["role"], row["text"] or "", _aware(row["created_at"]), row["seq"],
                row["response_id"], row["status"] or "completed")


def conversation_bytes(metadata: dict[str, str]) -> int:
    """What a conversation takes of its org's storage quota beside its items."""
    return CONVERSATION_BYTES + sum(len(k.encode()) + len(v.encode()) for k, v in metadata.items())


def item_bytes(item: Item) -> int:
    return ITEM_BYTES + len(item.text.encode())
