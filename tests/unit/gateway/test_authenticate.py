"""The gateway's request dependencies: a key last seen suspended stays refused while Redis is down (L7); what only
the internal port serves is not found on the public one (L4)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from starlette.exceptions import HTTPException
from starlette.requests import Request

from producers.gateway.deps import authenticate, internal_only, on_internal_port
from producers.gateway.errors import ApiError
from producers.gateway.keys import hash_key
from runtime.settings import Settings
from runtime.tenancy import ApiKey
from tests.fakes.tenancy import api_key

SETTINGS = Settings()


class OneKey:
    def __init__(self, secret: str, key: ApiKey) -> None:
        self._hash, self._key = hash_key(secret), key

    async def authenticate(self, key_hash: str) -> ApiKey:
        assert key_hash == self._hash
        return self._key


class RedisDown:
    """Suspensions whose Redis does not answer; ``last_known`` is what this gateway read before the outage."""

    def __init__(self, known: dict[str, str]) -> None:
        self._known = known

    async def reason(self, key_id: str) -> str | None:
        raise RedisConnectionError("down")

    def last_known(self, key_id: str) -> str | None:
        return self._known.get(key_id)


def _request(port: int, secret: str = "sk-test") -> Request:
    return Request({"type": "http", "method": "GET", "path": "/metrics", "headers": [
        (b"authorization", f"Bearer {secret}".encode())], "server": ("127.0.0.1", port), "query_string": b""})


def _ctx(key: ApiKey, known: dict[str, str]) -> Any:
    return SimpleNamespace(settings=SETTINGS, tenancy=OneKey("sk-test", key), suspensions=RedisDown(known))


async def test_while_redis_is_down_a_paid_key_last_seen_suspended_is_refused_and_the_others_served() -> None:
    abuser, fine = api_key("abuser", tier="plus"), api_key("fine", tier="plus")
    with pytest.raises(ApiError) as refused:
        await authenticate(_request(8000), _ctx(abuser, {"abuser": "request_burst: 500 in 10 s (limit 420)"}))
    assert (refused.value.status, refused.value.code) == (403, "key_suspended")
    assert await authenticate(_request(8000), _ctx(fine, {"abuser": "request_burst"})) is fine
    with pytest.raises(RedisConnectionError):  # a tier closed without Redis: the outage's 503
        await authenticate(_request(8000), _ctx(api_key("free", tier="free"), {}))


async def test_only_the_internal_port_is_internal() -> None:
    gateway = SETTINGS.gateway
    assert gateway.internal_port == gateway.port + 50
    assert on_internal_port(_request(gateway.internal_port), SETTINGS)
    assert not on_internal_port(_request(gateway.port), SETTINGS)
    with pytest.raises(HTTPException) as hidden:
        await internal_only(_request(gateway.port), SimpleNamespace(settings=SETTINGS))  # type: ignore[arg-type]
    assert hidden.value.status_code == 404
    await internal_only(_request(gateway.internal_port), SimpleNamespace(settings=SETTINGS))  # type: ignore[arg-type]
