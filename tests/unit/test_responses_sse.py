"""The Responses API's stream: every event type in order, sequence numbers from log positions, and a resume after
any event gives exactly the events after it (as on another gateway, which numbers them alike)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from producers.gateway.responses_protocol import ResponseView
from producers.relay.responses_sse import ResponseStream

VIEW = ResponseView(id="resp_1", created_at=1, model="m", output_item_id="msg_1_out", background=True)
DELTAS = [("Hel", 1), ("lo", 2), (" wor", 4), ("ld", 5)]  # positions; 3 was coalesced into 4
TEXT = "Hello world"


def parse(raw: bytes) -> list[dict[str, Any]]:
    events = []
    for block in raw.decode().split("\n\n"):
        if not block:
            continue
        kind, data = block.split("\n")
        body = orjson.loads(data.removeprefix("data: "))
        assert kind == f"event: {body['type']}"
        events.append(body)
    return events


def stream(after: int, status: str = "completed") -> list[dict[str, Any]]:
    fmt = ResponseStream(VIEW, starting_after=after)
    raw = fmt.opening() + b"".join(fmt.delta(text, position) for text, position in DELTAS)
    raw += fmt.ending(6, TEXT, status, incomplete_reason=None, usage={"total_tokens": 3},
                      error={"code": "x", "message": "y"} if status == "failed" else None, completed_at=2)
    return parse(raw)


def test_a_whole_stream_has_every_event_type_in_order() -> None:
    events = stream(-1)
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        *["response.output_text.delta"] * 4, "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in events] == [0, 1, 2, 3, 4, 5, 7, 8, 9, 10, 11, 12]
    assert events[0]["response"]["status"] == "queued" and events[1]["response"]["status"] == "in_progress"
    assert "".join(e["delta"] for e in events if "delta" in e) == TEXT == events[8]["text"]
    final = events[-1]["response"]
    assert final["status"] == "completed" and final["output"][0]["content"][0]["text"] == TEXT
    assert final["usage"] == {"total_tokens": 3} and final["id"] == "resp_1"


@pytest.mark.parametrize("after", range(-1, 13))
def test_a_resume_gives_exactly_the_events_after_the_clients(after: int) -> None:
    whole = stream(-1)
    assert stream(after) == [e for e in whole if e["sequence_number"] > after]


def test_a_failed_stream_ends_with_response_failed_alone() -> None:
    events = stream(-1, status="failed")
    assert events[-1]["type"] == "response.failed" and events[-1]["sequence_number"] == 9
    assert events[-1]["response"]["error"] == {"code": "x", "message": "y"}
    assert not any(e["type"] == "response.output_text.done" for e in events)
