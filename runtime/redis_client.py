"""The Redis client factory (redis.asyncio) and key naming."""

from __future__ import annotations

from redis.asyncio import Redis

from runtime.settings import RedisSettings


def make_redis(settings: RedisSettings) -> Redis:
    return Redis.from_url(settings.url, decode_responses=True, health_check_interval=30)


def key(settings: RedisSettings, *parts: str | int) -> str:
    return settings.key_prefix + ":".join(str(p) for p in parts)
