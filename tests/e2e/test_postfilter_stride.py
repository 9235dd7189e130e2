"""The post-filter re-checks a stream's output every 8 tokens (docs/PROCESSORS.md, the README): a stream that turns
harmful is decided at the first 8-token mark whose window is harmful, not later, and halted soon after."""

from __future__ import annotations

import openai
import pytest

from runtime.settings import Settings
from schemas.events import SafetyStage, SafetyVerdict, TokenEvent
from schemas.topics import TOPICS
from stream_processors.safety.classifier import make_classifier
from stream_processors.safety.policy import OutputWindow
from tests.e2e.conftest import MODEL, records_of, token_events
from tests.e2e.test_safety import MAX_SLIP_TOKENS, TURNS_HARMFUL
from tests.helpers import wait_for

pytestmark = pytest.mark.e2e

#: what the docs promise, not what the settings say: a processor checking less often must fail this test
STRIDE = 8


def checkpoints(events: list[TokenEvent], window_chars: int) -> list[tuple[int, str]]:
    """(tokens so far, window text) at each point an 8-token stride looks at the output, in order."""
    window, points = OutputWindow(STRIDE, window_chars), []
    for event in events:
        if event.finish_reason is None and window.add(event):
            points.append((window.tokens, window.text))
    return points


async def test_a_stream_that_turns_harmful_is_decided_at_the_first_harmful_stride_mark(offender: openai.OpenAI,
                                                                                      stack: Settings) -> None:
    chunks = list(offender.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": TURNS_HARMFUL}], temperature=0, max_tokens=200,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    request_id, usage = chunks[0].id, chunks[-1].usage
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        "content_filter"]
    (verdict,) = await wait_for(lambda: records_of(
        stack, TOPICS.verdicts, SafetyVerdict, lambda v: v.request_id == request_id and v.stage is SafetyStage.POST),
        what="the post-filter's verdict")
    events = [e for e in await token_events(stack, request_id) if e.attempt == 1]
    assert events and max(len(e.token_ids) for e in events) == 1  # one token per event: marks fall every 8 tokens

    # Each mark's window classified alone, as the processor does (one text, one thread: the same numbers).
    classifier = make_classifier(stack.safety)
    marks = checkpoints(events, stack.safety.post_window_chars)
    harmful = [tokens for tokens, text in marks if classifier.classify([text])[0].blocked]
    assert harmful, f"no window of the stream is harmful: {[t for _, t in marks][-1:]}"
    assert verdict.blocked and verdict.at_token == harmful[0], (
        f"decided at token {verdict.at_token}; the first harmful window ends at token {harmful[0]} "
        f"(marks: {[tokens for tokens, _ in marks]})")
    assert verdict.at_token % STRIDE == 0
    assert 0 <= usage.completion_tokens - verdict.at_token <= MAX_SLIP_TOKENS
