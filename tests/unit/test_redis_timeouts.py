"""A Redis that stops answering fails each command within the socket timeout instead of hanging whoever waits
(defect 7: ``make_redis`` set no socket timeouts, so admission, key checks and lease renewals could hang)."""

from __future__ import annotations

import asyncio
import time

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from runtime.redis_client import make_redis
from runtime.settings import RedisSettings


async def test_a_silent_redis_times_out_instead_of_hanging() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(-1)  # accepts, reads, never answers

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    redis = make_redis(RedisSettings(url=f"redis://127.0.0.1:{port}/0", socket_timeout_s=0.3,
                                     connect_timeout_s=0.3))
    started = time.monotonic()
    try:
        with pytest.raises((RedisTimeoutError, RedisConnectionError)):
            await asyncio.wait_for(redis.get("k"), 10)
        assert time.monotonic() - started < 3
    finally:
        await redis.aclose()
        server.close()
