"""The Redis client factory (redis.asyncio) and key naming.

Every command has a deadline: a Redis that stops answering (a restart, a network partition) fails the command
within ``socket_timeout_s`` instead of hanging admission, key checks or lease renewals.
"""

from __future__ import annotations

from redis.asyncio import BlockingConnectionPool, Redis

from runtime.settings import RedisSettings


def make_redis(settings: RedisSettings) -> Redis:
    # A burst beyond the pool waits for a free connection (up to pool_timeout_s) instead of failing: redis-py's
    # default pool raises "Too many connections" past 100 concurrent commands, e.g. 400 streams authenticating.
    pool = BlockingConnectionPool.from_url(
        settings.url, decode_responses=True, health_check_interval=30, max_connections=settings.max_connections,
        timeout=settings.pool_timeout_s, socket_timeout=settings.socket_timeout_s,
        socket_connect_timeout=settings.connect_timeout_s,
    )
    return Redis.from_pool(pool)  # owns the pool: aclose() disconnects it


def key(settings: RedisSettings, *parts: str | int) -> str:
    return settings.key_prefix + ":".join(str(p) for p in parts)


def request_claim_key(settings: RedisSettings, request_id: str) -> str:
    """A request's claim (``inference_workers/claims.py``): who generates it, and ``done`` once its commit is
    through; the gateway reads ``done`` to answer a cancel of a finished completion."""
    return key(settings, "request", request_id)


def gateway_alive_key(settings: RedisSettings, gateway_id: str) -> str:
    """Set (with a TTL) by a living gateway process; workers stop generating for gateways without it."""
    return key(settings, "gateway-alive", gateway_id)
