"""A burst of commands beyond the Redis pool waits for a free connection instead of failing."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from runtime.redis_client import make_redis
from runtime.settings import Settings


@pytest.mark.asyncio(loop_scope="session")
async def test_burst_beyond_the_pool_waits(stack: Settings) -> None:
    client = make_redis(stack.redis.model_copy(update={"max_connections": 2, "pool_timeout_s": 10.0}))
    key = f"kns:test:pool:{uuid.uuid4().hex}"
    try:
        # Each BLPOP holds its connection for 0.2 s: 10 of them need 5 rounds through a pool of 2.
        results = await asyncio.gather(*(client.blpop([key], timeout=0.2) for _ in range(10)))
        assert results == [None] * 10
    finally:
        await client.aclose()
