"""The worker's own small HTTP server: ``/health``, ``/metrics`` (Prometheus) and ``/state`` (what it runs)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from runtime.metrics import metrics_router


def create_admin_app(problems: Callable[[], list[str]], state: Callable[[], dict[str, Any]]) -> FastAPI:
    app = FastAPI(title="kns worker admin")

    @app.get("/health")
    async def _health() -> JSONResponse:
        found = problems()
        return JSONResponse({"status": "unhealthy" if found else "ok", "problems": found},
                            status_code=503 if found else 200)

    @app.get("/state")
    async def _state() -> JSONResponse:
        return JSONResponse(state())

    app.include_router(metrics_router)
    return app


def admin_server(app: FastAPI, host: str, port: int) -> uvicorn.Server:
    config = uvicorn.Config(app, host=host, port=port, log_config=None, access_log=False, lifespan="off")
    server = uvicorn.Server(config)
    # The worker handles signals itself; the admin server must not take them over.
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]
    return server
