"""The Responses API's stream: ``response.*`` server-sent events, each with its ``sequence_number``.

Sequence numbers come from the stream's positions in the log (``runtime/streams.py``), not from a counter of what
this gateway sent: a stream resumed on another gateway (``starting_after``) numbers its events exactly as the first
one did, and sends only those after the client's. Position ``p`` of a delta is event ``p + 3`` (0-3 are the
stream's opening: created, in_progress, output_item.added, content_part.added); the end, at position ``e`` past the
last delta, is ``e + 3`` on (text done, part done, item done, completed), or ``e + 3`` alone when it failed.
Deltas a gateway coalesces into one event skip the numbers between: clients need them increasing, not dense.
"""

from __future__ import annotations

from typing import Any

import orjson

from producers.gateway.responses_protocol import ResponseView, message_item, output_part, response_object

#: the sequence number of a delta at position 0 (the opening events come before)
OPENING = 3
FINAL_EVENT = {"completed": "response.completed", "incomplete": "response.incomplete"}


def event(kind: str, sequence_number: int, body: dict[str, Any]) -> bytes:
    return (b"event: " + kind.encode() + b"\ndata: "
            + orjson.dumps({"type": kind, "sequence_number": sequence_number, **body}) + b"\n\n")


class ResponseStream:
    """Formats one response's stream for a client that has the events through ``starting_after`` (-1: none)."""

    def __init__(self, view: ResponseView, *, starting_after: int = -1) -> None:
        self._view = view
        self._after = starting_after
        self._item = {"item_id": view.output_item_id, "output_index": 0, "content_index": 0}

    def has(self, sequence_number: int) -> bool:
        return sequence_number <= self._after

    def opening(self) -> bytes:
        view = self._view
        first = response_object(view, "queued" if view.background else "in_progress")
        events: list[tuple[str, dict[str, Any]]] = [
            ("response.created", {"response": first}),
            ("response.in_progress", {"response": response_object(view, "in_progress")}),
            ("response.output_item.added", {"output_index": 0, "item": {
                "id": view.output_item_id, "type": "message", "status": "in_progress", "role": "assistant",
                "content": []}}),
            ("response.content_part.added", {**self._item, "part": output_part("")}),
        ]
        return b"".join(event(kind, n, body) for n, (kind, body) in enumerate(events) if not self.has(n))

    def delta(self, text: str, position: int) -> bytes:
        n = position + OPENING
        if self.has(n):
            return b""
        return event("response.output_text.delta", n, {**self._item, "delta": text, "logprobs": []})

    def ending(self, end_position: int, text: str, status: str, *, incomplete_reason: str | None,
               usage: dict[str, Any] | None, error: dict[str, Any] | None, completed_at: int | None) -> bytes:
        """The events after the last delta: the text, part and item done and the response's end; or, failed or
        cancelled, ``response.failed`` alone (the Responses API streams no cancellation event)."""
        n = end_position + OPENING
        if status not in FINAL_EVENT:
            body = response_object(self._view, status, usage=usage, error=error)
            return b"" if self.has(n) else event("response.failed", n, {"response": body})
        item = message_item(self._view.output_item_id, text, status)
        final = response_object(self._view, status, output=[item], usage=usage, incomplete_reason=incomplete_reason,
                                completed_at=completed_at)
        events: list[tuple[str, dict[str, Any]]] = [
            ("response.output_text.done", {**self._item, "text": text, "logprobs": []}),
            ("response.content_part.done", {**self._item, "part": output_part(text)}),
            ("response.output_item.done", {"output_index": 0, "item": item}),
            (FINAL_EVENT[status], {"response": final}),
        ]
        return b"".join(event(kind, n + i, body) for i, (kind, body) in enumerate(events) if not self.has(n + i))
