"""The Conversations API use case: create, retrieve, update, delete, list, and a conversation's items (list, read,
add, delete).

Turns are appended by the conversation writer from the log (``stream_processors/store``), never here: a gateway
creates a conversation (with its initial items), adds and deletes a client's items, and reads. Everything is within
the caller's org: another org's id is answered as unknown (404), as is a deleted one, at once.

Writes are admitted and bounded (issue 37 H3): a create, a metadata update, an items create and an item delete are
requests of the key's and the org's rate limits (one request each, no tokens: ``Admission``, before the body is even
parsed), each item a client writes holds at most ``gateway.conversation_item_max_chars``, and what the org's
conversations keep stays within its tier's ``conversation_storage_bytes`` (counted by the store). They are not
billed: a conversation's items are billed as prompt tokens when a turn uses them, as OpenAI's; storage is bounded by
the quota instead of priced. Conversations have no TTL, as OpenAI's: the quota alone bounds them, and no
conversation a client returns to after months is lost.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from datetime import UTC
from typing import Any, TypeVar

from producers.gateway.admission import Admission
from producers.gateway.errors import ApiError, bad_request, unavailable
from producers.gateway.pending_writes import PendingWrites
from producers.gateway.responses_protocol import ConversationCreate, ConversationItemsCreate
from producers.gateway.stored import STORE_ERRORS, list_page
from producers.gateway.turns import conversation_not_found
from runtime.settings import TierTable
from runtime.tenancy import ApiKey
from schemas.events import utcnow
from schemas.ids import CONVERSATION_PREFIX, ITEM_PREFIX, input_item_id, new_conversation_id, plausible
from stream_processors.store.conversations import (
    PURGE_AFTER_S,
    Conversation,
    ConversationNotFound,
    ConversationStore,
    Item,
    conversation_bytes,
    item_bytes,
)

#: the most characters an item of a created conversation holds unless the gateway's settings say otherwise
ITEM_MAX_CHARS = 32_768


def item_not_found(item_id: str) -> ApiError:
    return ApiError(404, f"Item with id '{item_id}' not found.", param="item_id", code="not_found")


T = TypeVar("T")


async def _stored(reading: Awaitable[T]) -> T:
    """What the store answers; a store that cannot answer is the client's 503, never a 500."""
    try:
        return await reading
    except STORE_ERRORS as exc:
        raise unavailable("Conversations are unavailable right now; retry later.") from exc


class ConversationService:
    def __init__(self, store: ConversationStore, pending: PendingWrites | None = None, *,
                 admission: Admission | None = None, tiers: TierTable | None = None,
                 item_max_chars: int = ITEM_MAX_CHARS) -> None:
        self._store = store
        self._pending = pending
        #: None: writes are not rate-limited (tests of other concerns), or not held to a storage quota
        self._admission = admission
        self._tiers = tiers
        self._item_max_chars = item_max_chars

    async def create(self, body: Callable[[], ConversationCreate], key: ApiKey) -> dict[str, Any]:
        """``body`` parses the request's body: only once the write is admitted (a throttled key's megabyte is not
        parsed)."""
        conversation_id = new_conversation_id()
        async with self._admitted(key):
            parsed = body()
            at = utcnow()
            conversation = Conversation(conversation_id, key.org_id, at, parsed.metadata or {})
            items = [Item(input_item_id(conversation_id, i), m.role, m.text(), at, i)
                     for i, m in enumerate(parsed.items or [])]
            self._check_items(items)
            await self._within_quota(key, conversation_bytes(conversation.metadata) + sum(map(item_bytes, items)))
            await _stored(self._store.create(conversation, items))
        return conversation_object(conversation)

    async def get(self, conversation_id: str, key: ApiKey) -> dict[str, Any]:
        return conversation_object(await self._conversation(conversation_id, key))

    async def add_items(self, conversation_id: str, body: Callable[[], ConversationItemsCreate], key: ApiKey
                        ) -> dict[str, Any]:
        """A client's items, after the conversation's newest (OpenAI's ``conversations.items.create``): one write
        of the key's limits, held to the org's storage quota; parsed once admitted."""
        self._check(conversation_id)
        async with self._admitted(key):
            parsed = body()
            await self._conversation(conversation_id, key)
            batch, at = uuid.uuid4().hex, utcnow()
            items = [Item(input_item_id(batch, i), m.role, m.text(), at, i) for i, m in enumerate(parsed.items)]
            self._check_items(items)
            await self._within_quota(key, sum(map(item_bytes, items)))
            if not await _stored(self._store.append(conversation_id, items)):
                raise conversation_not_found(conversation_id, "conversation_id")  # deleted meanwhile
        return list_page([item_object(i) for i in items], False)

    async def delete_item(self, conversation_id: str, item_id: str, key: ApiKey) -> dict[str, Any]:
        """Delete one item (OpenAI's ``conversations.items.delete``): answers the conversation. Its storage is
        given back; a turn's item answered a moment ago is waited for first (it may not be written yet)."""
        self._check(conversation_id)
        if not plausible(item_id, ITEM_PREFIX):
            raise item_not_found(item_id)
        async with self._admitted(key):
            conversation = await self._conversation(conversation_id, key)
            await self._written(conversation_id, key)
            deleted = await _stored(self._store.delete_item(conversation_id, key.org_id, item_id))
        if deleted is None:
            raise conversation_not_found(conversation_id, "conversation_id")
        if not deleted:
            raise item_not_found(item_id)
        return conversation_object(conversation)

    async def update(self, conversation_id: str, metadata: Callable[[], dict[str, str]], key: ApiKey
                     ) -> dict[str, Any]:
        """``metadata`` parses the request's body, once the write is admitted."""
        self._check(conversation_id)
        async with self._admitted(key):
            replacing = metadata()
            current = await self._conversation(conversation_id, key)
            await self._within_quota(key, conversation_bytes(replacing) - conversation_bytes(current.metadata))
            updated = await _stored(self._store.update_metadata(conversation_id, key.org_id, replacing))
        if updated is None:
            raise conversation_not_found(conversation_id, "conversation_id")
        return conversation_object(updated)

    @asynccontextmanager
    async def _admitted(self, key: ApiKey) -> AsyncIterator[None]:
        """A write, as one request of the key's and the org's limits (requests per minute, in flight); no tokens,
        nothing to generate or settle."""
        if self._admission is None:
            yield
            return
        ticket = await self._admission.admit(f"write_{uuid.uuid4().hex}", 0, key)
        try:
            yield
        finally:
            await self._admission.unsent(ticket, certain=True)  # its slot free, its reservation (of 0) gone

    def _check_items(self, items: list[Item]) -> None:
        for item in items:
            if len(item.text) > self._item_max_chars:
                raise bad_request(f"Invalid 'items[{item.seq}].content': string too long. Expected a string with "
                                  f"maximum length {self._item_max_chars}, but got a string with length "
                                  f"{len(item.text)} instead.", param=f"items[{item.seq}].content",
                                  code="string_above_max_length")

    async def _within_quota(self, key: ApiKey, adding: int) -> None:
        """429 ``insufficient_quota`` when ``adding`` bytes would take the org's conversations past its tier's
        storage quota (nothing is refused that keeps less)."""
        if self._tiers is None or adding <= 0:
            return
        quota = self._tiers.policy(key.tier).conversation_storage_bytes
        used = await _stored(self._store.storage_used(key.org_id))
        if used + adding > quota:
            raise storage_quota_exceeded(key, used, quota, adding)

    async def delete(self, conversation_id: str, key: ApiKey) -> dict[str, Any]:
        self._check(conversation_id)
        deleted = await _stored(self._store.delete(conversation_id, key.org_id))
        if not deleted:
            raise conversation_not_found(conversation_id, "conversation_id")
        return {"id": conversation_id, "object": "conversation.deleted", "deleted": True}

    async def list(self, key: ApiKey, *, after: str | None, limit: int) -> dict[str, Any]:
        try:
            page = await _stored(self._store.list_owned(key.org_id, after=after, limit=limit))
        except KeyError as exc:
            raise ApiError(404, f"No conversation with id '{after}' to list after.", param="after",
                           code="not_found") from exc
        return list_page([conversation_object(c) for c in page.items], page.has_more)

    async def items(self, conversation_id: str, key: ApiKey, *, after: str | None, limit: int,
                    ascending: bool) -> dict[str, Any]:
        self._check(conversation_id)
        if after is not None and not plausible(after, ITEM_PREFIX):
            raise item_not_found(after)
        await self._written(conversation_id, key)
        try:
            page = await _stored(self._store.items(conversation_id, key.org_id, after=after, limit=limit,
                                                   ascending=ascending))
        except ConversationNotFound as exc:
            raise conversation_not_found(conversation_id, "conversation_id") from exc
        except KeyError as exc:
            raise ApiError(404, f"No item with id '{after}' in this conversation.", param="after",
                           code="not_found") from exc
        return list_page([item_object(i) for i in page.items], page.has_more)

    async def item(self, conversation_id: str, item_id: str, key: ApiKey) -> dict[str, Any]:
        await self._conversation(conversation_id, key)
        if not plausible(item_id, ITEM_PREFIX):
            raise item_not_found(item_id)
        await self._written(conversation_id, key)
        found = await _stored(self._store.get_item(conversation_id, key.org_id, item_id))
        if found is None:
            raise item_not_found(item_id)
        return item_object(found)

    async def _written(self, conversation_id: str, key: ApiKey) -> None:
        """Read-your-writes: the conversation's turn answered a moment ago is waited for until the writer appended
        it (on any gateway; ``pending_writes.py``)."""
        if self._pending is None:
            return

        async def item_written(item_id: str) -> bool:
            return await _stored(self._store.written(conversation_id, key.org_id, item_id))

        await self._pending.turn(conversation_id, item_written, lambda: self._conversation(conversation_id, key))

    async def _conversation(self, conversation_id: str, key: ApiKey) -> Conversation:
        self._check(conversation_id)
        found = await _stored(self._store.get(conversation_id, key.org_id))
        if found is None:
            raise conversation_not_found(conversation_id, "conversation_id")
        return found

    @staticmethod
    def _check(conversation_id: str) -> None:
        if not plausible(conversation_id, CONVERSATION_PREFIX):
            raise conversation_not_found(conversation_id, "conversation_id")


def storage_quota_exceeded(key: ApiKey, used: int, quota: int, adding: int) -> ApiError:
    """As OpenAI answers a spent quota (429 ``insufficient_quota``, no Retry-After: waiting does not help)."""
    return ApiError(429, f"You exceeded your conversation storage quota: organization {key.org_id}'s conversations "
                         f"keep {used} bytes of its {quota}, and this request would add {adding}. Delete "
                         "conversations you no longer need (a deleted conversation's storage is given back when it "
                         f"is purged, {PURGE_AFTER_S // 86_400} days after its delete), or ask for a higher tier.",
                    type="insufficient_quota", code="storage_quota_exceeded")


def conversation_object(conversation: Conversation) -> dict[str, Any]:
    return {"id": conversation.conversation_id, "object": "conversation",
            "created_at": int(conversation.created_at.astimezone(UTC).timestamp()),
            "metadata": dict(conversation.metadata)}


def item_object(item: Item) -> dict[str, Any]:
    kind = "output_text" if item.role == "assistant" else "input_text"
    part: dict[str, Any] = {"type": kind, "text": item.text}
    if kind == "output_text":
        part["annotations"] = []
    return {"id": item.item_id, "type": "message", "status": item.status, "role": item.role, "content": [part]}
