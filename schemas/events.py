"""The Python face of the platform's events.

Each model is the twin of one Avro schema in ``schemas/avro/<event>/v<n>.avsc`` (the newest version); the
contract tests prove that field names, types and optionality agree and that every model round-trips through
its schema. Change both together, as a new schema version.
"""

from __future__ import annotations

import enum
from datetime import UTC, datetime

from pydantic import BaseModel, ConfigDict, Field


class Event(BaseModel):
    """Base of every event: immutable, strict about unknown fields."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class ChatMessage(Event):
    role: str
    content: str
    name: str | None = None


class SamplingSpec(Event):
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_tokens: int = 0
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0


class ReplyTo(Event):
    partition: int
    gateway_id: str


class ChatRequest(Event):
    request_id: str
    created_at: datetime
    org_id: str
    key_id: str
    tier: str
    model: str
    messages: list[ChatMessage]
    prompt_token_ids: list[int]
    sampling: SamplingSpec
    stream: bool
    reply: ReplyTo
    conversation_id: str | None = None
    user: str | None = None
    client_addr: str | None = None

    @property
    def partition_key(self) -> str:
        # A conversation's turns land on one partition, hence one worker: its prefix cache stays warm.
        return self.conversation_id or self.request_id


class TokenUsage(Event):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class TokenEvent(Event):
    request_id: str
    attempt: int
    seq: int
    token_offset: int
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    usage: TokenUsage | None = None
    error: str | None = None
    worker_id: str
    emitted_at_us: int

    @property
    def is_final(self) -> bool:
        return self.finish_reason is not None


class ControlAction(enum.StrEnum):
    CANCEL = "CANCEL"
    HALT = "HALT"
    # Reader default for actions added by newer writers.
    UNKNOWN = "UNKNOWN"


class ControlEvent(Event):
    request_id: str
    action: ControlAction
    reason: str
    issued_by: str
    issued_at: datetime


class UsageEvent(Event):
    request_id: str
    org_id: str
    key_id: str
    tier: str
    model: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reason: str
    attempt: int
    worker_id: str
    requested_at: datetime
    started_at: datetime
    finished_at: datetime
    conversation_id: str | None = None


class SafetyStage(enum.StrEnum):
    PRE = "PRE"
    POST = "POST"
    UNKNOWN = "UNKNOWN"


class SafetyVerdict(Event):
    request_id: str
    stage: SafetyStage
    blocked: bool
    category: str
    score: float
    classifier: str
    org_id: str | None = None
    key_id: str | None = None
    at_token: int = 0
    decided_at: datetime


class AbuseAction(enum.StrEnum):
    FLAG = "FLAG"
    SUSPEND = "SUSPEND"
    UNKNOWN = "UNKNOWN"


class AbuseAlert(Event):
    alert_id: str
    key_id: str
    org_id: str
    tier: str
    rule: str
    observed: float
    threshold: float
    window_start: datetime
    window_s: float
    action: AbuseAction
    raised_at: datetime


def utcnow() -> datetime:
    return datetime.now(UTC)
