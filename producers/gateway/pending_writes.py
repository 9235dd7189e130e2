"""Read-your-writes for what the store processor writes from the log.

Stored completions, stored responses and a conversation's turns are written by the conversation writer
(``stream_processors/store``) from the record the worker commits with a request's final event: a moment after the
client saw its answer end (the writer's commit interval). A client whose create returned must find them at once,
on any gateway. So the gateway that relays such a final notes it in Redis before the client sees the end (one
pipelined round trip), and a read that finds the note but not yet the row waits for the row, at most ``wait_s``:

* ``pending:<request id>``: a stored completion or a stored response is on its way;
* ``pending-turn:<conversation id>``: the conversation's answered turn whose items are on their way.

A read without a note costs one Redis round trip and never waits. When Redis cannot be asked, the read goes on with
what is written (as before), and a note that could not be written leaves its reads as they were.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from redis.asyncio import Redis
from redis.exceptions import RedisError

from runtime.metrics import GATEWAY_READ_WAITS
from runtime.redis_client import key
from runtime.settings import RedisSettings
from schemas.ids import output_item_id

log = logging.getLogger(__name__)
T = TypeVar("T")
#: Redis failures: a note unknown is a note absent
REDIS_ERRORS = (RedisError, OSError, TimeoutError)


class PendingWrites:
    def __init__(self, redis: Redis, settings: RedisSettings, *, wait_s: float, poll_s: float = 0.05) -> None:
        self._redis = redis
        self._settings = settings
        self._wait_s = wait_s
        self._poll_s = poll_s
        #: a note outlives any read's wait by far, and the writer's slowest catch-up after a restart
        self._ttl_s = max(60, int(wait_s * 12))

    def _key(self, request_id: str) -> str:
        return key(self._settings, "pending", request_id)

    def _turn_key(self, conversation_id: str) -> str:
        return key(self._settings, "pending-turn", conversation_id)

    async def note(self, request_id: str, org_id: str, *, stored: bool, conversation_id: str | None) -> None:
        """A final the writer will store has been relayed: ``stored`` (a stored completion or response row of
        ``org_id``), and ``conversation_id`` when its turn is appended there."""
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                if stored:
                    pipe.set(self._key(request_id), org_id, ex=self._ttl_s)
                if conversation_id:
                    pipe.set(self._turn_key(conversation_id), request_id, ex=self._ttl_s)
                await pipe.execute()
        except REDIS_ERRORS as exc:
            log.warning("pending write not noted; a read right after may miss it",
                        extra={"request_id": request_id, "reason": repr(exc)})

    async def forget(self, request_id: str) -> None:
        """The row was deleted: reads by its id no longer wait for it (else each would wait ``wait_s`` for nothing
        while the note lives)."""
        try:
            await self._redis.delete(self._key(request_id))
        except REDIS_ERRORS as exc:
            log.warning("pending note not forgotten; reads of the deleted row wait out the note",
                        extra={"request_id": request_id, "reason": repr(exc)})

    async def row(self, request_id: str, org_id: str, read: Callable[[], Awaitable[T | None]]) -> T | None:
        """``read()``'s row; when it is not written yet but noted as on its way (for the reader's org: nobody waits
        on another org's id), the row once written, or None after the wait."""
        found = await read()
        if found is not None:
            return found
        try:
            noted = await self._redis.get(self._key(request_id))
        except REDIS_ERRORS:
            return None
        if noted is None or (noted if isinstance(noted, str) else noted.decode()) != org_id:
            return None
        return await self._until(read)

    async def turn(self, conversation_id: str, item_written: Callable[[str], Awaitable[bool]],
                   readable: Callable[[], Awaitable[object]]) -> None:
        """Returns once the conversation's last answered turn is written (its answer item), or after the wait.
        ``readable`` raises (the caller's 404) for a conversation the caller may not read: nobody waits for another
        org's conversation."""
        try:
            request_id = await self._redis.get(self._turn_key(conversation_id))
        except REDIS_ERRORS:
            return
        if request_id is None:
            return
        await readable()
        item_id = output_item_id(request_id if isinstance(request_id, str) else request_id.decode())

        async def written() -> bool | None:
            return await item_written(item_id) or None

        await self._until(written)

    async def _until(self, read: Callable[[], Awaitable[T | None]]) -> T | None:
        deadline = time.monotonic() + self._wait_s
        started = time.monotonic()
        while True:
            found = await read()
            if found is not None:
                GATEWAY_READ_WAITS.labels(outcome="written").observe(time.monotonic() - started)
                return found
            if time.monotonic() >= deadline:
                GATEWAY_READ_WAITS.labels(outcome="timed_out").observe(time.monotonic() - started)
                return None
            await asyncio.sleep(self._poll_s)
