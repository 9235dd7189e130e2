"""OpenAI chat-completion wire formats: ``chat.completion.chunk`` SSE events and the final ``chat.completion``.

Chunks are built as plain dicts and serialised with orjson; the content chunk, which runs once per delta per
stream, is spliced from bytes prepared once per stream around the JSON-encoded text. Every event but
``[DONE]`` carries an ``id:`` (``<request id>:<position>``, see ``runtime/streams.py``): a client that lost its
connection reconnects to any gateway with it as ``Last-Event-ID`` and gets the rest of the stream. Without ids
(``event_ids=False``) the events are OpenAI's bytes exactly, for parsers that take each event for one ``data:``
line.
"""

from __future__ import annotations

from typing import Any

import orjson

from runtime.streams import ID_SEPARATOR, event_id

DONE = b"data: [DONE]\n\n"


class ChunkFormatter:
    """Formats one request's stream; holds the fields every chunk repeats."""

    def __init__(self, request_id: str, model: str, created: int, *, include_usage: bool,
                 event_ids: bool = True) -> None:
        self._request_id = request_id
        self._event_ids = event_ids
        self._head = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model}
        self._include_usage = include_usage
        # What orjson writes for a content chunk, split around the text (tests/unit/test_sse.py keeps them equal).
        marker = "\0text\0"
        before, after = self._event({"content": marker}, None, 0).split(orjson.dumps(marker), 1)
        self._content_head = before[before.index(b"data: "):]
        self._content_tail = after
        self._id_prefix = f"id: {request_id}{ID_SEPARATOR}".encode()
        self._id_content_head = b"\n" + self._content_head

    def _event(self, delta: dict[str, Any], finish_reason: str | None, position: int) -> bytes:
        chunk: dict[str, Any] = {
            **self._head,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
        }
        if self._include_usage:
            chunk["usage"] = None
        return self.frame(chunk, position)

    def frame(self, body: dict[str, Any], position: int) -> bytes:
        """One SSE event, with its id unless ids are off."""
        data = b"data: " + orjson.dumps(body) + b"\n\n"
        if not self._event_ids:
            return data
        return b"id: " + event_id(self._request_id, position).encode() + b"\n" + data

    def role(self) -> bytes:
        return self._event({"role": "assistant", "content": ""}, None, 0)

    def content(self, text: str, position: int) -> bytes:
        if not self._event_ids:
            return b"".join((self._content_head, orjson.dumps(text), self._content_tail))
        return b"".join((self._id_prefix, str(position).encode(), self._id_content_head, orjson.dumps(text),
                         self._content_tail))

    def finish(self, finish_reason: str, position: int) -> bytes:
        return self._event({}, finish_reason, position)

    def usage(self, usage: dict[str, Any], position: int) -> bytes:
        return self.frame({**self._head, "choices": [], "usage": usage}, position)


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
