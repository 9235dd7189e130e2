"""Every operation by id on a stored completion reads its own writes (found by schemathesis's stateful phase, issue
36): a ``DELETE`` or ``GET .../messages`` right after the create finds the completion the writer is still storing,
and once deleted, reads by its id answer 404 at once instead of waiting for a row that will never come. Real Redis
notes (``PendingWrites``); the writer's table is a dict that the writer fills a moment later."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import pytest
from redis.asyncio import Redis

from producers.gateway.errors import ApiError
from producers.gateway.pending_writes import PendingWrites
from producers.gateway.stored import StoredCompletions
from runtime.settings import Settings

ORG = "org-by-id"


class Table:
    """The stored completions the writer has written (a completion id → its row)."""

    def __init__(self) -> None:
        self.rows: dict[str, dict[str, Any]] = {}

    async def get(self, completion_id: str, org_id: str) -> dict[str, Any] | None:
        row = self.rows.get(completion_id)
        return row if row is not None and row["org_id"] == org_id else None

    async def delete(self, completion_id: str, org_id: str) -> bool:
        return self.rows.pop(completion_id, None) is not None if await self.get(completion_id, org_id) else False

    def write_later(self, completion_id: str, after_s: float) -> asyncio.Task[None]:
        async def write() -> None:
            await asyncio.sleep(after_s)  # the writer's commit interval, as the real one lags
            self.rows[completion_id] = {"org_id": ORG, "messages": '[{"role": "user", "content": "hi"}]'}

        return asyncio.ensure_future(write())


async def noted(stack: Settings, redis: Redis) -> tuple[StoredCompletions, Table, str]:
    pending = PendingWrites(redis, stack.redis, wait_s=3.0, poll_s=0.01)
    completion_id = f"chatcmpl-{uuid.uuid4().hex}"
    await pending.note(completion_id, ORG, stored=True, conversation_id=None)  # its final was relayed
    table = Table()
    return StoredCompletions(table, pending), table, completion_id  # type: ignore[arg-type]


async def test_a_delete_right_after_the_create_deletes_what_the_writer_stores(stack: Settings, redis: Redis) -> None:
    stored, table, completion_id = await noted(stack, redis)
    writing = table.write_later(completion_id, 0.3)
    assert (await stored.delete(completion_id, ORG))["deleted"]
    await writing
    assert completion_id not in table.rows


async def test_messages_right_after_the_create_are_found(stack: Settings, redis: Redis) -> None:
    stored, table, completion_id = await noted(stack, redis)
    writing = table.write_later(completion_id, 0.3)
    page = await stored.messages(completion_id, ORG, after=None, limit=20, ascending=True)
    await writing
    assert [m["content"] for m in page["data"]] == ["hi"]


async def test_reads_of_a_deleted_completion_answer_404_without_waiting(stack: Settings, redis: Redis) -> None:
    stored, table, completion_id = await noted(stack, redis)
    table.rows[completion_id] = {"org_id": ORG, "messages": "[]"}
    await stored.delete(completion_id, ORG)
    started = time.monotonic()
    for read in (stored.get(completion_id, ORG), stored.delete(completion_id, ORG),
                 stored.messages(completion_id, ORG, after=None, limit=20, ascending=True)):
        with pytest.raises(ApiError) as refused:
            await read
        assert refused.value.status == 404
    assert time.monotonic() - started < 1.0  # a note left behind would hold each read for its 3 s wait
