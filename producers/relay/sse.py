"""OpenAI chat-completion wire formats: ``chat.completion.chunk`` SSE events and the final ``chat.completion``.

Chunks are built as plain dicts and serialised with orjson: this runs once per delta per stream.
"""

from __future__ import annotations

from typing import Any

import orjson

DONE = b"data: [DONE]\n\n"


class ChunkFormatter:
    """Formats one request's stream; holds the fields every chunk repeats."""

    def __init__(self, request_id: str, model: str, created: int, *, include_usage: bool) -> None:
        self._head = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model}
        self._include_usage = include_usage

    def _event(self, delta: dict[str, Any], finish_reason: str | None) -> bytes:
        chunk: dict[str, Any] = {
            **self._head,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
        }
        if self._include_usage:
            chunk["usage"] = None
        return b"data: " + orjson.dumps(chunk) + b"\n\n"

    def role(self) -> bytes:
        return self._event({"role": "assistant", "content": ""}, None)

    def content(self, text: str) -> bytes:
        return self._event({"content": text}, None)

    def finish(self, finish_reason: str) -> bytes:
        return self._event({}, finish_reason)

    def usage(self, usage: dict[str, Any]) -> bytes:
        return b"data: " + orjson.dumps({**self._head, "choices": [], "usage": usage}) + b"\n\n"


def error_event(body: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(body) + b"\n\n"


def completion(request_id: str, model: str, created: int, text: str, finish_reason: str,
               usage: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": text, "refusal": None},
            "logprobs": None,
            "finish_reason": finish_reason,
        }],
        "usage": usage,
        "system_fingerprint": None,
    }
