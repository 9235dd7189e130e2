from __future__ import annotations

from runtime.tracing import child_of, from_headers, new_traceparent, to_headers, trace_id


def test_child_keeps_the_trace_and_changes_the_span() -> None:
    parent = new_traceparent()
    child = child_of(parent)
    assert trace_id(child) == trace_id(parent)
    assert child.split("-")[2] != parent.split("-")[2]


def test_malformed_parent_starts_a_new_trace() -> None:
    assert trace_id(child_of("garbage")) is not None


def test_headers_round_trip() -> None:
    tp = new_traceparent()
    assert from_headers([*to_headers(tp), ("other", b"x")]) == tp
    assert from_headers(None) is None
