"""Retry what failed for a transient reason (the error's type says so), with capped exponential backoff."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from cassandra import OperationTimedOut, ReadTimeout, Unavailable, WriteTimeout
from cassandra.cluster import NoHostAvailable
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError as RedisOutOfMemoryError
from redis.exceptions import TimeoutError as RedisTimeoutError

T = TypeVar("T")
log = logging.getLogger(__name__)

#: Redis full (``maxmemory``, ``noeviction``) refuses writes until keys expire: a sink waits, as for Redis down
TRANSIENT: tuple[type[BaseException], ...] = (
    OperationTimedOut, Unavailable, WriteTimeout, ReadTimeout, NoHostAvailable,
    RedisConnectionError, RedisTimeoutError, RedisOutOfMemoryError, ConnectionError, TimeoutError,
)


async def retry_transient(call: Callable[[], Awaitable[T]], *, what: str, max_delay_s: float = 5.0) -> T:
    """Await ``call()`` until it succeeds; transient errors are retried forever (a sink must not skip records),
    anything else propagates."""
    delay = 0.1
    while True:
        try:
            return await call()
        except TRANSIENT as exc:
            log.warning("transient failure; retrying", extra={"what": what, "reason": repr(exc), "delay_s": delay})
            await asyncio.sleep(delay)
            delay = min(delay * 2, max_delay_s)
