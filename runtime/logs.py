"""Structured JSON logs. Every record carries the service name and, inside a request's scope, its request id."""

from __future__ import annotations

import contextvars
import logging
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import orjson

from runtime.settings import ObservabilitySettings

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)

# Attributes every LogRecord has; anything else was passed with ``extra=`` and goes into the JSON.
_STANDARD = set(logging.makeLogRecord({}).__dict__) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        payload: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "service": self.service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        request_id = getattr(record, "request_id", None) or request_id_var.get()
        if request_id:
            payload["request_id"] = request_id
        for key, value in record.__dict__.items():
            if key not in _STANDARD and key not in payload:
                payload[key] = value
        if record.exc_info:
            payload["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(payload, default=str).decode()


def configure_logging(obs: ObservabilitySettings, service: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if obs.json_logs:
        handler.setFormatter(JsonFormatter(service))
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s {service} %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(obs.log_level.upper())
    # Client libraries are chatty at INFO; their warnings still come through.
    for noisy in ("aiokafka", "cassandra", "kafka", "uvicorn.access", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


@contextmanager
def request_scope(request_id: str) -> Iterator[None]:
    token = request_id_var.set(request_id)
    try:
        yield
    finally:
        request_id_var.reset(token)
