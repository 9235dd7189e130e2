"""Fakes of the conversation and Responses use cases' collaborators (stores, Redis, publisher, relay), and
builders of their rows, views and token events, for unit tests."""

from __future__ import annotations

from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

import orjson

from producers.gateway.responses_protocol import ResponseView
from producers.gateway.turns import TurnAsk, TurnPlanner
from producers.relay.collector import StreamCollector
from runtime.settings import GatewaySettings, RedisSettings
from runtime.streams import StreamRecord
from schemas.events import ChatMessage, TokenEvent
from stream_processors.store.conversations import Item
from stream_processors.store.responses import StoredResponse

NOW = datetime(2026, 11, 24, 12, 0, tzinfo=UTC)


async def _count_tokens(messages: list[ChatMessage]) -> list[int]:
    return [1] * (4 + sum(4 + len(m.content.split()) for m in messages))


def prompts(max_model_len: int = 2048) -> Any:
    """A PromptBuilder for model "m" without a tokenizer: a few tokens per message and per word."""
    return SimpleNamespace(card=SimpleNamespace(served_name="m", max_model_len=max_model_len), tokens=_count_tokens)


class Responses:
    """A ResponseStore over a dict; counts its reads."""

    def __init__(self, rows: list[StoredResponse] | None = None) -> None:
        self.rows = {r.response_id: r for r in rows or []}
        self.gone: dict[str, StoredResponse] = {}
        self.reads = 0
        self.deleted: list[str] = []

    async def get(self, response_id: str, org_id: str) -> StoredResponse | None:
        self.reads += 1
        row = self.rows.get(response_id)
        return row if row is not None and row.org_id == org_id else None

    async def ended(self, response_id: str) -> StoredResponse | None:
        return self.rows.get(response_id) or self.gone.get(response_id)

    async def delete(self, response_id: str, org_id: str) -> bool:
        row = self.rows.pop(response_id, None)
        if row is None or row.org_id != org_id:
            return False
        self.deleted.append(response_id)
        self.gone[response_id] = row
        return True


class Conversations:
    """A conversation store whose conversation exists and whose previous turn's answer is never written."""

    def __init__(self, history: list[Item] | None = None) -> None:
        self._history = history or []

    async def get(self, conversation_id: str, org_id: str) -> object | None:
        return object()

    async def get_item(self, conversation_id: str, org_id: str, item_id: str) -> Item | None:
        return None

    async def written(self, conversation_id: str, org_id: str, item_id: str) -> bool:
        return False

    async def history(self, conversation_id: str, *, max_items: int) -> list[Item]:
        return self._history[-max_items:]


class Redis:
    def __init__(self, last_turn: str | None = None) -> None:
        self.last_turn = last_turn

    async def get(self, key: str) -> str | None:
        return self.last_turn

    async def set(self, key: str, value: str, ex: int | None = None) -> None:
        self.last_turn = value

    async def eval(self, script: str, numkeys: int, key: str, request_id: str) -> None:
        if self.last_turn == request_id:
            self.last_turn = None


class Streams:
    """A StreamDirectory over a dict."""

    def __init__(self, *records: StreamRecord) -> None:
        self.records = {r.request_id: r for r in records}

    async def lookup(self, request_id: str) -> StreamRecord | None:
        return self.records.get(request_id)

    async def forget(self, request_id: str) -> None:
        self.records.pop(request_id, None)


async def _nothing_in_flight(response_id: str, org_id: str) -> bool:
    return False


def planner(*, responses: Responses | None = None, conversations: Conversations | None = None,
            redis: Redis | None = None, in_flight: Any = _nothing_in_flight, max_model_len: int = 2048,
            **gateway: Any) -> TurnPlanner:
    return TurnPlanner(prompts(max_model_len), conversations or Conversations(), responses or Responses(),  # type: ignore[arg-type]
                       redis or Redis(), RedisSettings(), GatewaySettings(instance_id="gw", **gateway),  # type: ignore[arg-type]
                       in_flight=in_flight)


def ask(**fields: Any) -> TurnAsk:
    return TurnAsk(**{"api": "responses", "org_id": "org", "new_input": [ChatMessage(role="user", content="Hi")],
                      **fields})


def row(response_id: str, previous: str | None, *, status: str = "completed", text: str = "a",
        background: bool = False) -> StoredResponse:
    return StoredResponse(response_id=response_id, org_id="org", key_id="k", user=None, model="m", created_at=NOW,
                          status=status, input_items=[{"role": "user", "content": "q"}], output_text=text,
                          prompt_tokens=1, completion_tokens=1, cached_tokens=0, previous_response_id=previous,
                          background=background)


def view(**fields: Any) -> ResponseView:
    return ResponseView(**{"id": "resp_abc", "created_at": 1, "model": "m", "output_item_id": "msg_abc_out",
                           **fields})


def record(extra: ResponseView, org_id: str = "org") -> StreamRecord:
    return StreamRecord(extra.id, org_id, 0, 0, "m", 1, False, "gw/1", extra=extra.to_json())


class Relay:
    def register(self, request_id: str) -> StreamCollector:
        return StreamCollector(request_id)

    def unregister(self, request_id: str) -> None:
        pass


def token(seq: int, text: str) -> TokenEvent:
    return TokenEvent(request_id="resp_abc", attempt=1, seq=seq, token_offset=seq, token_ids=[seq], text=text,
                      worker_id="w", emitted_at_us=seq)


def parse(raw: bytes) -> list[dict[str, Any]]:
    return [orjson.loads(block.split("\ndata: ", 1)[1]) for block in raw.decode().split("\n\n") if block]
