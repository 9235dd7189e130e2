"""Stored responses (/v1/responses with store: true) in Cassandra: written once per response, read by every gateway.

Table ``stored_responses`` (``infra/local/cassandra/schema.cql``), one row per response id, every statement at
LOCAL_QUORUM. A write is ``INSERT ... IF NOT EXISTS`` with a TTL: the first copy of a redelivered record wins and a
deleted response stays deleted. A delete marks the row (``deleted_at``): reads answer 404 at once, the TTL purges it.
"""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import orjson
from cassandra.cluster import Session

from runtime.cassandra_client import execute
from runtime.cassandra_client import prepare as prepare_at_quorum

#: how long a stored response is kept (as OpenAI keeps them)
RETENTION_S = 30 * 24 * 3600

_COLUMNS = ("response_id", "org_id", "key_id", "user_id", "model", "created_at", "status", "input_items",
            "output_text", "prompt_tokens", "completion_tokens", "cached_tokens", "conversation_id",
            "previous_response_id", "instructions", "error", "incomplete_reason", "truncated_items", "metadata",
            "max_output_tokens", "temperature", "top_p", "background", "completed_at", "truncation", "text_format")


@dataclass(frozen=True)
class StoredResponse:
    response_id: str
    org_id: str
    key_id: str
    user: str | None
    model: str
    created_at: datetime
    #: "completed" | "incomplete" | "failed" | "cancelled"
    status: str
    #: the turn's new input messages, ``[{"role": ..., "content": ...}]``
    input_items: list[dict[str, str]]
    output_text: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    conversation_id: str | None = None
    previous_response_id: str | None = None
    instructions: str | None = None
    #: the failure message (status failed)
    error: str | None = None
    #: "max_output_tokens" | "content_filter"
    incomplete_reason: str | None = None
    truncated_items: int = 0
    metadata: dict[str, str] = field(default_factory=dict)
    max_output_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    background: bool = False
    completed_at: datetime | None = None
    truncation: str = "disabled"
    #: the request's ``text.format`` as JSON (None: plain text)
    text_format: str | None = None


class ResponseStore:
    def __init__(self, session: Session, keyspace: str) -> None:
        self._session = session
        ks = keyspace

        prepare = functools.partial(prepare_at_quorum, session)
        self._insert = prepare(f"INSERT INTO {ks}.stored_responses ({', '.join(_COLUMNS)}) "
                               f"VALUES ({', '.join('?' * len(_COLUMNS))}) IF NOT EXISTS USING TTL {RETENTION_S}")
        self._get = prepare(f"SELECT {', '.join(_COLUMNS)}, deleted_at FROM {ks}.stored_responses "
                            "WHERE response_id = ?")
        # Conditional on the org: a delete racing the TTL cannot leave a row of only deleted_at behind.
        self._delete = prepare(f"UPDATE {ks}.stored_responses USING TTL {RETENTION_S} SET deleted_at = ? "
                               "WHERE response_id = ? IF org_id = ? AND deleted_at = null")

    @classmethod
    async def open(cls, session: Session, keyspace: str) -> ResponseStore:
        return await asyncio.to_thread(cls, session, keyspace)

    async def write(self, response: StoredResponse) -> bool:
        """Store one response (idempotent). False: it was there already (a redelivery, or deleted since)."""
        result = await execute(self._session, self._insert, _params(response))
        return bool(result[0]["[applied]"])

    async def get(self, response_id: str, org_id: str) -> StoredResponse | None:
        """An org's live stored response; None when unknown, another org's or deleted."""
        rows = await execute(self._session, self._get, [response_id])
        if not rows or rows[0]["org_id"] != org_id or rows[0]["deleted_at"] is not None:
            return None
        return _response(rows[0])

    async def ended(self, response_id: str) -> StoredResponse | None:
        """A response's row whether or not it was deleted since (how it ended: what its admission settles)."""
        rows = await execute(self._session, self._get, [response_id])
        return _response(rows[0]) if rows else None

    async def delete(self, response_id: str, org_id: str) -> bool:
        """False when :meth:`get` would be None (or a concurrent delete won)."""
        result = await execute(self._session, self._delete, [datetime.now(UTC), response_id, org_id])
        return bool(result[0]["[applied]"])


def _params(r: StoredResponse) -> list[Any]:
    return [r.response_id, r.org_id, r.key_id, r.user, r.model, r.created_at, r.status,
            orjson.dumps(r.input_items).decode(), r.output_text, r.prompt_tokens, r.completion_tokens,
            r.cached_tokens, r.conversation_id, r.previous_response_id, r.instructions, r.error, r.incomplete_reason,
            r.truncated_items, r.metadata, r.max_output_tokens, r.temperature, r.top_p, r.background, r.completed_at,
            r.truncation, r.text_format]


def _response(row: dict[str, Any]) -> StoredResponse:
    completed_at = row["completed_at"]
    return StoredResponse(
        response_id=row["response_id"], org_id=row["org_id"], key_id=row["key_id"], user=row["user_id"],
        model=row["model"], created_at=row["created_at"].replace(tzinfo=UTC), status=row["status"],
        input_items=orjson.loads(row["input_items"] or "[]"), output_text=row["output_text"] or "",
        prompt_tokens=row["prompt_tokens"], completion_tokens=row["completion_tokens"],
        cached_tokens=row["cached_tokens"], conversation_id=row["conversation_id"],
        previous_response_id=row["previous_response_id"], instructions=row["instructions"], error=row["error"],
        incomplete_reason=row["incomplete_reason"], truncated_items=row["truncated_items"] or 0,
        metadata=dict(row["metadata"] or {}), max_output_tokens=row["max_output_tokens"],
        temperature=row["temperature"], top_p=row["top_p"], background=bool(row["background"]),
        completed_at=None if completed_at is None else completed_at.replace(tzinfo=UTC),
        truncation=row["truncation"] or "disabled", text_format=row["text_format"])
