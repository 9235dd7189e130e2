"""Backing-store failures before a request is accepted answer 503 in OpenAI's shape, never 500: Redis full
(``maxmemory`` with ``noeviction`` refuses writes) as Redis down."""

from __future__ import annotations

import pytest
from cassandra.cluster import NoHostAvailable
from fastapi import FastAPI
from fastapi.testclient import TestClient
from redis.exceptions import MaxConnectionsError, OutOfMemoryError

from producers.gateway import errors


def app_raising(exc: Exception) -> FastAPI:
    app = FastAPI()
    errors.install(app)

    @app.get("/boom")
    async def boom() -> None:
        raise exc

    return app


@pytest.mark.parametrize("exc", [MaxConnectionsError("Too many connections"), NoHostAvailable("down", {}),
                                 OutOfMemoryError("command not allowed when used memory > 'maxmemory'.")])
def test_dependency_errors_are_503_in_openai_shape(exc: Exception) -> None:
    response = TestClient(app_raising(exc), raise_server_exceptions=False).get("/boom")
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "service_unavailable"
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_other_errors_stay_500() -> None:
    response = TestClient(app_raising(RuntimeError("bug")), raise_server_exceptions=False).get("/boom")
    assert response.status_code == 500
    assert response.json()["error"]["code"] == "internal_error"
