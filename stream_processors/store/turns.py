"""What a recorded turn writes: its conversation's items and its stored response (the conversation writer's
mappings, pure so that they are tested without Cassandra).

Item ids derive from the request id (``schemas/ids.py``): a redelivered record rewrites the same rows. Only a turn
that was answered is appended (completed, or incomplete with some text: cut by max_output_tokens or the output
filter); a failed, cancelled or refused turn is not, and its client can send it again. Its response row records
how it ended whatever it was.
"""

from __future__ import annotations

from schemas.events import StoredCompletion, Turn, utcnow
from schemas.ids import input_item_id, output_item_id
from stream_processors.store.conversations import Item
from stream_processors.store.responses import StoredResponse

#: a turn's finish reason → its response status and incomplete reason
STATUS: dict[str, tuple[str, str | None]] = {
    "stop": ("completed", None),
    "length": ("incomplete", "max_output_tokens"),
    "content_filter": ("incomplete", "content_filter"),
    "cancelled": ("cancelled", None),
}


def status_of(stored: StoredCompletion) -> tuple[str, str | None]:
    if stored.error is not None or stored.finish_reason not in STATUS:
        return "failed", None
    return STATUS[stored.finish_reason]


def answered(status: str, text: str) -> bool:
    """Whether a turn that ended so is part of its conversation (and of the history after it)."""
    return status == "completed" or (status == "incomplete" and bool(text))


def items_of(stored: StoredCompletion) -> tuple[list[Item], Item] | None:
    """The turn's input items and its answer, for its conversation; None when nothing is appended."""
    if stored.conversation_id is None or stored.turn is None or not answered(status_of(stored)[0], stored.text):
        return None
    at, request_id = stored.created_at, stored.completion_id
    inputs = [Item(input_item_id(request_id, i), m.role, m.content, at, i, request_id)
              for i, m in enumerate(stored.messages)]
    status, _ = status_of(stored)
    answer = Item(output_item_id(request_id), "assistant", stored.text, at, len(inputs), request_id, status)
    return inputs, answer


def response_of(stored: StoredCompletion) -> StoredResponse | None:
    """The stored response of a Responses API turn with ``store: true``; None otherwise."""
    turn: Turn | None = stored.turn
    if turn is None or turn.api != "responses" or not turn.store:
        return None
    status, reason = status_of(stored)
    return StoredResponse(
        response_id=stored.completion_id, org_id=stored.org_id, key_id=stored.key_id, user=stored.user,
        model=stored.model, created_at=stored.created_at, status=status,
        input_items=[{"role": m.role, "content": m.content} for m in stored.messages], output_text=stored.text,
        prompt_tokens=stored.usage.prompt_tokens, completion_tokens=stored.usage.completion_tokens,
        cached_tokens=stored.usage.cached_tokens, conversation_id=stored.conversation_id,
        previous_response_id=turn.previous_response_id, instructions=turn.instructions, error=stored.error,
        incomplete_reason=reason, truncated_items=turn.truncated_items, metadata=dict(stored.metadata),
        max_output_tokens=turn.max_output_tokens, background=turn.background, temperature=turn.temperature,
        top_p=turn.top_p, truncation=turn.truncation, completed_at=utcnow(), text_format=turn.text_format)
