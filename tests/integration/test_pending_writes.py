"""Read-your-writes notes on the real Redis (``producers/gateway/pending_writes.py``): a read waits only for a row
noted as on its way for its own org, and only until it is written or the wait ends."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from redis.asyncio import Redis

from producers.gateway.errors import ApiError
from producers.gateway.pending_writes import PendingWrites
from runtime.settings import Settings
from schemas.ids import output_item_id


def writes(stack: Settings, redis: Redis, wait_s: float = 2.0) -> PendingWrites:
    return PendingWrites(redis, stack.redis, wait_s=wait_s, poll_s=0.01)


class Row:
    """A row the writer writes at some point (never: None)."""

    def __init__(self, after_s: float | None) -> None:
        self._at = None if after_s is None else time.monotonic() + after_s
        self.reads = 0

    async def read(self) -> str | None:
        self.reads += 1
        return "row" if self._at is not None and time.monotonic() >= self._at else None


async def test_a_read_without_a_note_reads_once_and_never_waits(stack: Settings, redis: Redis) -> None:
    row = Row(0.2)
    assert await writes(stack, redis).row(f"resp_{uuid.uuid4().hex}", "org", row.read) is None
    assert row.reads == 1


async def test_a_noted_row_is_waited_for_until_the_writer_writes_it(stack: Settings, redis: Redis) -> None:
    pending, request_id = writes(stack, redis), f"resp_{uuid.uuid4().hex}"
    await pending.note(request_id, "org", stored=True, conversation_id=None)
    started = time.monotonic()
    assert await pending.row(request_id, "org", Row(0.3).read) == "row"
    assert 0.3 <= time.monotonic() - started < 1.5


async def test_a_noted_row_never_written_is_given_up_after_the_wait(stack: Settings, redis: Redis) -> None:
    pending, request_id = writes(stack, redis, wait_s=0.3), f"resp_{uuid.uuid4().hex}"
    await pending.note(request_id, "org", stored=True, conversation_id=None)
    started = time.monotonic()
    assert await pending.row(request_id, "org", Row(None).read) is None
    assert 0.3 <= time.monotonic() - started < 1.5


async def test_another_orgs_read_of_a_noted_id_does_not_wait(stack: Settings, redis: Redis) -> None:
    pending, request_id = writes(stack, redis), f"chatcmpl-{uuid.uuid4().hex}"
    await pending.note(request_id, "org-a", stored=True, conversation_id=None)
    row = Row(None)
    assert await pending.row(request_id, "org-b", row.read) is None and row.reads == 1


async def test_a_conversations_answered_turn_is_waited_for_and_only_by_who_may_read_it(
        stack: Settings, redis: Redis) -> None:
    pending, conversation_id = writes(stack, redis), f"conv_{uuid.uuid4().hex}"
    request_id = f"resp_{uuid.uuid4().hex}"
    await pending.note(request_id, "org", stored=False, conversation_id=conversation_id)
    written_at = time.monotonic() + 0.3
    asked: list[str] = []

    async def item_written(item_id: str) -> bool:
        asked.append(item_id)
        return time.monotonic() >= written_at

    async def readable() -> None:
        return None

    await pending.turn(conversation_id, item_written, readable)
    assert time.monotonic() >= written_at and set(asked) == {output_item_id(request_id)}

    async def foreign() -> None:
        raise ApiError(404, "no such conversation")

    with pytest.raises(ApiError):
        await asyncio.wait_for(pending.turn(conversation_id, item_written, foreign), 0.2)
