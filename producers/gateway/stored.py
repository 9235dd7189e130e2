"""Stored chat completions (``store: true``): retrieve, its messages, list, delete, in OpenAI's shapes.

The store processor writes them from the log (``stream_processors/store``); this use case only reads and deletes,
through :class:`CompletionStore`, always within the caller's org: another org's id is answered as unknown. A delete
forgets the completion's stream too: no gateway replays what was deleted (issue 37 L1).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import UTC
from typing import Any

import orjson
from cassandra import DriverException

from producers.gateway.errors import ApiError, unavailable
from producers.gateway.pending_writes import PendingWrites
from producers.gateway.protocol import usage_dict
from producers.relay.sse import completion
from stream_processors.store.completions import CompletionStore

#: what a Cassandra outage looks like to the driver's caller
STORE_ERRORS = (DriverException, OSError, TimeoutError)


def not_found(completion_id: str) -> ApiError:
    return ApiError(404, f"No stored chat completion found with id '{completion_id}'.", param="completion_id",
                    code="not_found")


#: makes a stream unresumable on every gateway (``ChatService.forget_stream``; 503 when it cannot)
ForgetStream = Callable[[str], Awaitable[None]]


class StoredCompletions:
    def __init__(self, store: CompletionStore, pending: PendingWrites | None = None, *,
                 forget_stream: ForgetStream | None = None) -> None:
        self._store = store
        self._pending = pending
        self._forget_stream = forget_stream

    async def _row(self, completion_id: str, org_id: str) -> dict[str, Any]:
        try:
            row = await self._store.get(completion_id, org_id)
        except STORE_ERRORS as exc:
            raise unavailable("Stored completions are unavailable right now; retry later.") from exc
        if row is None:
            raise not_found(completion_id)
        return row

    async def _written(self, completion_id: str, org_id: str) -> dict[str, Any] | None:
        """The completion's row; read-your-writes: one that ended a moment ago is waited for until the writer stored
        it (every operation by id: a client that deletes what it just created must find it too)."""

        async def row() -> dict[str, Any] | None:  # not found yet, unless it is another org's
            try:
                return await self._row(completion_id, org_id)
            except ApiError as exc:
                if exc.status == 404:
                    return None
                raise

        if self._pending is None:
            return await row()
        return await self._pending.row(completion_id, org_id, row)

    async def get(self, completion_id: str, org_id: str) -> dict[str, Any]:
        found = await self._written(completion_id, org_id)
        if found is None:
            raise not_found(completion_id)
        return _completion(found)

    async def messages(self, completion_id: str, org_id: str, *, after: str | None, limit: int,
                       ascending: bool) -> dict[str, Any]:
        row = await self._written(completion_id, org_id)
        if row is None:
            raise not_found(completion_id)
        messages = [{"id": f"{completion_id}-{i}", "role": m["role"], "content": m["content"],
                     "name": m.get("name"), "content_parts": None}
                    for i, m in enumerate(orjson.loads(row["messages"] or "[]"))]
        if not ascending:
            messages.reverse()
        if after is not None:
            ids = [m["id"] for m in messages]
            if after not in ids:
                raise ApiError(404, f"No message with id '{after}' in this completion.", param="after",
                               code="not_found")
            messages = messages[ids.index(after) + 1:]
        return list_page(messages[:limit], len(messages) > limit)

    async def list(self, org_id: str, *, after: str | None, limit: int, ascending: bool, model: str | None,
                   metadata: dict[str, str]) -> dict[str, Any]:
        try:
            page = await self._store.page(org_id, after=after, limit=limit, ascending=ascending, model=model,
                                          metadata=metadata)
        except KeyError as exc:
            raise ApiError(404, f"No stored chat completion with id '{after}' to list after.", param="after",
                           code="not_found") from exc
        except STORE_ERRORS as exc:
            raise unavailable("Stored completions are unavailable right now; retry later.") from exc
        return list_page([_completion(row) for row in page.items], page.has_more)

    async def delete(self, completion_id: str, org_id: str) -> dict[str, Any]:
        try:
            deleted = await self._store.delete(completion_id, org_id)
            if not deleted and await self._written(completion_id, org_id) is not None:
                deleted = await self._store.delete(completion_id, org_id)
        except STORE_ERRORS as exc:
            raise unavailable("Stored completions are unavailable right now; retry later.") from exc
        if not deleted:
            raise not_found(completion_id)
        # Unreadable at once everywhere: its stream, still resumable from the log for a while, no longer is
        if self._forget_stream is not None:
            await self._forget_stream(completion_id)
        if self._pending is not None:
            await self._pending.forget(completion_id)  # reads by its id stop waiting for the row
        return {"object": "chat.completion.deleted", "id": completion_id, "deleted": True}


def _completion(row: dict[str, Any]) -> dict[str, Any]:
    created = int(row["created_at"].replace(tzinfo=UTC).timestamp()) if row["created_at"] else 0
    body = completion(row["completion_id"], row["model"], created, row["content"] or "", row["finish_reason"],
                      usage_dict(row["prompt_tokens"] or 0, row["completion_tokens"] or 0, row["cached_tokens"] or 0))
    return {**body, "metadata": dict(row["metadata"] or {}), "request_id": row["completion_id"]}


def list_page(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}
