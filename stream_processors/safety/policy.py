"""What the safety filters look at (the whole prompt, in windows), and what a refusal or a halt is. Pure functions,
no I/O."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime

from schemas.events import (
    ChatRequest,
    ControlAction,
    ControlEvent,
    ErrorCode,
    SafetyStage,
    SafetyVerdict,
    TokenEvent,
    TokenUsage,
    utcnow,
)
from stream_processors.safety.classifier import Verdict

PREFILTER = "safety-prefilter"
POSTFILTER = "safety-postfilter"


#: the newest user turn is classified whole (this much of its end), at the classifier's usual bar
PRIMARY_CHARS = 2000
#: every message is also classified in windows of at most this many characters: a sentence, or a run of short ones
WINDOW_CHARS = 320
#: sentences shorter than this are screened together with the next: tiny sentences cannot multiply the windows
MIN_WINDOW_CHARS = 16
#: a prompt has at most about this many windows: a longer prompt's windows are longer
MAX_WINDOWS = 256
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n\s*\n")
_LETTER = re.compile(r"[^\W\d_]")


@dataclass(frozen=True)
class PromptWindows:
    """What the pre-filter classifies of one request: the newest user turn whole at the usual bar (what asks for
    something now), and all the text that reaches the model in windows at the context bar (classifier.py): every
    message of every role (system and developer messages, a Responses turn's instructions, supplied or fabricated
    history, a conversation's items) and every part of a long message, padding or not."""

    primary: str
    context: tuple[str, ...]


def prompt_windows(request: ChatRequest) -> PromptWindows:
    messages = request.messages
    newest = next((m.content for m in reversed(messages) if m.role == "user"), messages[-1].content if messages else "")
    primary = newest[-PRIMARY_CHARS:]
    least = max(MIN_WINDOW_CHARS, sum(len(m.content) for m in messages) // MAX_WINDOWS)
    most = max(WINDOW_CHARS, 2 * least)
    # A window that is the primary text already has the usual bar's verdict, which the context bar never overrules
    context = dict.fromkeys(w for m in messages for w in windows(m.content, least=least, most=most) if w != primary)
    return PromptWindows(primary, tuple(context))


def windows(text: str, *, least: int = MIN_WINDOW_CHARS, most: int = WINDOW_CHARS) -> list[str]:
    """The text in windows: its sentences (whitespace folded, those without a letter dropped), the short ones run
    together up to ``least`` characters, any longer than ``most`` cut into overlapping pieces."""
    found: list[str] = []
    run = ""
    for piece in _SENTENCE_END.split(text):
        sentence = " ".join(piece.split())
        if not _LETTER.search(sentence):
            continue  # punctuation, numbers, padding: nothing to read
        run = f"{run} {sentence}" if run else sentence
        if len(run) >= least:
            found += _pieces(run, most)
            run = ""
    return found + (_pieces(run, most) if run else [])


def _pieces(text: str, most: int) -> list[str]:
    """Windows of ``most`` characters, each starting half a window after the previous: whatever is at most half a
    window long lies whole in one of them."""
    if len(text) <= most:
        return [text]
    step = most // 2
    return [text[start:start + most] for start in range(0, len(text) - most + step, step)]


def expired(request: ChatRequest, now: datetime) -> TokenEvent | None:
    """The final event of a request whose queue deadline passed before it was screened (its client gets
    ``queue_deadline_exceeded`` at once; nothing is generated, nothing billed), else None."""
    if request.deadline_at is None or now <= request.deadline_at:
        return None
    return TokenEvent(request_id=request.request_id, attempt=1, seq=0, token_offset=0, token_ids=[], text="",
                      finish_reason="error", error="the request waited past its queue deadline before screening",
                      error_code=ErrorCode.QUEUE_DEADLINE_EXCEEDED.value, worker_id=PREFILTER,
                      emitted_at_us=int(now.timestamp() * 1_000_000))


def unreadable(request_id: str, reason: str) -> TokenEvent:
    """The final event of a request the safety processor cannot decode (a schema it does not know yet)."""
    return TokenEvent(request_id=request_id, attempt=1, seq=0, token_offset=0, token_ids=[], text="",
                      finish_reason="error", error=f"the safety processor cannot read the request ({reason})",
                      error_code=ErrorCode.UNDECODABLE_REQUEST.value, worker_id=PREFILTER,
                      emitted_at_us=int(utcnow().timestamp() * 1_000_000))


def refusal(request: ChatRequest) -> TokenEvent:
    """The final token event a refused request gets: the relay ends the stream with content_filter."""
    return TokenEvent(request_id=request.request_id, attempt=1, seq=0, token_offset=0, token_ids=[], text="",
                      finish_reason="content_filter", usage=TokenUsage(prompt_tokens=0, completion_tokens=0),
                      worker_id=PREFILTER, emitted_at_us=int(utcnow().timestamp() * 1_000_000))


def verdict_event(request_id: str, stage: SafetyStage, verdict: Verdict, classifier: str, *,
                  org_id: str | None = None, key_id: str | None = None, at_token: int = 0) -> SafetyVerdict:
    return SafetyVerdict(request_id=request_id, stage=stage, blocked=verdict.blocked, category=verdict.category,
                         score=verdict.score, classifier=classifier, org_id=org_id, key_id=key_id,
                         at_token=at_token, decided_at=utcnow())


def halt(request_id: str, verdict: Verdict) -> ControlEvent:
    return ControlEvent(request_id=request_id, action=ControlAction.HALT,
                        reason=f"content filter: {verdict.category}", issued_by=POSTFILTER, issued_at=utcnow())


@dataclass
class OutputWindow:
    """One request's output as the post-filter sees it: the latest text, and when to look at it next."""

    stride: int
    window_chars: int
    tokens: int = 0
    next_check: int = 0
    text: str = ""
    halted: bool = False
    attempt: int = 0
    seen: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.next_check = self.stride

    def add(self, event: TokenEvent) -> bool:
        """Take one event; True when the window is due for classification (every ``stride`` tokens, and at the end)."""
        if event.attempt != self.attempt:  # a failover restarts the output
            self.attempt, self.tokens, self.text, self.seen = event.attempt, 0, "", set()
            self.next_check = self.stride
        if event.seq in self.seen:  # a redelivered event
            return False
        self.seen.add(event.seq)
        self.tokens += len(event.token_ids)
        self.text = (self.text + event.text)[-self.window_chars:]
        if event.finish_reason is not None:
            return bool(self.text.strip())
        if self.tokens >= self.next_check:
            self.next_check = self.tokens + self.stride
            return True
        return False
