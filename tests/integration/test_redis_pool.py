"""A burst of commands beyond the Redis pool waits for a free connection instead of failing
(redis-py's default pool raised "Too many connections" past 100: 500s for a burst of streams)."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from runtime.redis_client import make_redis
from runtime.settings import Settings


@pytest.mark.asyncio(loop_scope="session")
async def test_burst_beyond_the_pool_waits(stack: Settings) -> None:
    client = make_redis(stack.redis)
    key = f"kns:test:pool:{uuid.uuid4().hex}"
    try:
        # Each BLPOP holds its connection for 0.2 s; 200 at once is more than the pool holds.
        results = await asyncio.gather(*(client.blpop([key], timeout=0.2) for _ in range(200)))
        assert results == [None] * 200
    finally:
        await client.aclose()
