from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from redis.asyncio import Redis

from runtime.redis_client import make_redis
from runtime.settings import Settings


@pytest_asyncio.fixture(loop_scope="session")
async def redis(stack: Settings) -> AsyncIterator[Redis]:
    client = make_redis(stack.redis)
    yield client
    await client.aclose()


@pytest.fixture()
def kafka(stack: Settings):  # type: ignore[no-untyped-def]
    return stack.kafka

