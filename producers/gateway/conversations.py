"""The Conversations API use case: create, retrieve, update, delete, list, and read a conversation's items.

Turns are appended by the conversation writer from the log (``stream_processors/store``), never here: a gateway
creates a conversation (with its initial items) and reads. Everything is within the caller's org: another org's
id is answered as unknown (404), as is a deleted one, at once.
"""

from __future__ import annotations

from collections.abc import Awaitable
from datetime import UTC
from typing import Any, TypeVar

from producers.gateway.errors import ApiError, unavailable
from producers.gateway.pending_writes import PendingWrites
from producers.gateway.responses_protocol import ConversationCreate
from producers.gateway.stored import STORE_ERRORS, list_page
from producers.gateway.turns import conversation_not_found
from producers.tenancy.view import ApiKey
from schemas.events import utcnow
from schemas.ids import CONVERSATION_PREFIX, ITEM_PREFIX, input_item_id, new_conversation_id, plausible
from stream_processors.store.conversations import Conversation, ConversationNotFound, ConversationStore, Item


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
    def __init__(self, store: ConversationStore, pending: PendingWrites | None = None) -> None:
        self._store = store
        self._pending = pending

    async def create(self, body: ConversationCreate, key: ApiKey) -> dict[str, Any]:
        conversation_id = new_conversation_id()
        at = utcnow()
        conversation = Conversation(conversation_id, key.org_id, at, body.metadata or {})
        items = [Item(input_item_id(conversation_id, i), m.role, m.text(), at, i)
                 for i, m in enumerate(body.items or [])]
        await _stored(self._store.create(conversation, items))
        return conversation_object(conversation)

    async def get(self, conversation_id: str, key: ApiKey) -> dict[str, Any]:
        return conversation_object(await self._conversation(conversation_id, key))

    async def update(self, conversation_id: str, metadata: dict[str, str], key: ApiKey) -> dict[str, Any]:
        self._check(conversation_id)
        updated = await _stored(self._store.update_metadata(conversation_id, key.org_id, metadata))
        if updated is None:
            raise conversation_not_found(conversation_id, "conversation_id")
        return conversation_object(updated)

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
            return await _stored(self._store.get_item(conversation_id, key.org_id, item_id)) is not None

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
