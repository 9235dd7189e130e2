"""W3C trace context (``traceparent``) carried in Kafka record headers from gateway to worker to relay."""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterable, Sequence

HEADER = "traceparent"
_PATTERN = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")

KafkaHeaders = list[tuple[str, bytes]]


def new_traceparent() -> str:
    return f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"


def child_of(parent: str | None) -> str:
    """A new span in the parent's trace (a fresh trace when the parent is missing or malformed)."""
    match = _PATTERN.match(parent or "")
    if match is None:
        return new_traceparent()
    return f"00-{match.group(1)}-{secrets.token_hex(8)}-{match.group(3)}"


def trace_id(traceparent: str | None) -> str | None:
    match = _PATTERN.match(traceparent or "")
    return match.group(1) if match else None


def to_headers(traceparent: str) -> KafkaHeaders:
    return [(HEADER, traceparent.encode())]


def from_headers(headers: Sequence[tuple[str, bytes]] | Iterable[tuple[str, bytes]] | None) -> str | None:
    for key, value in headers or ():
        if key == HEADER:
            return value.decode(errors="replace")
    return None
