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
    #: v5: structured output: the JSON schema (as JSON text) every answer validates against; ``{"type": "object"}``
    #: for JSON mode; None: free text
    json_schema: str | None = None
    #: v5: added to the logits of these token ids (decimal strings: Avro map keys), -100 to 100 (OpenAI's)
    logit_bias: dict[str, float] = Field(default_factory=dict)


class ReplyTo(Event):
    partition: int
    gateway_id: str


class Turn(Event):
    """v4: a request that is one turn of a conversation (Responses API, or a chat completion continuing a
    ``conversation_id``): what the conversation writer appends and what a stored response records."""

    #: "responses" | "chat"
    api: str
    #: how many of the request's last messages are the turn's new input (the rest: instructions and history)
    input_count: int
    instructions: str | None = None
    previous_response_id: str | None = None
    #: the Responses API's ``store``: keep the response for ``GET /v1/responses/{id}``
    store: bool = True
    background: bool = False
    #: oldest history items left out to fit the model's context (``truncation: "auto"``)
    truncated_items: int = 0
    max_output_tokens: int | None = None
    #: "auto" | "disabled", and the sampling asked for: what a stored response reports
    truncation: str = "disabled"
    temperature: float = 1.0
    top_p: float = 1.0
    #: v5: the Responses API's ``text.format`` as JSON (None: plain text), for a stored response to report
    text_format: str | None = None


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
    #: v2: generation must start before this time, or the request is refused (not generated, not billed)
    deadline_at: datetime | None = None
    #: v3: the client asked to store the completion (``store: true``), with its metadata
    store: bool = False
    metadata: dict[str, str] = Field(default_factory=dict)
    #: v4: a conversation's turn (None: a plain chat completion)
    turn: Turn | None = None

    @property
    def keeps_record(self) -> bool:
        """Whether the worker writes a :class:`StoredCompletion` (a stored completion, or a turn to record)."""
        return self.store or self.turn is not None

    @property
    def background(self) -> bool:
        """A background response: generated to its end whether or not anyone listens."""
        return self.turn is not None and self.turn.background

    @property
    def readable_later(self) -> bool:
        """Whether its client can read the answer without its stream: a stored completion or response, or a turn
        its conversation appends (a ``store: false`` response outside a conversation is kept nowhere)."""
        stored = self.turn.store if self.turn is not None and self.turn.api == "responses" else self.store
        return stored or self.conversation_id is not None

    @property
    def runs_unattended(self) -> bool:
        """Generated to its end whether or not any client connection is attached: a background response, or a
        non-streamed request whose answer is kept (:attr:`readable_later`): its client cannot resume it and reads
        the record instead. Its client hanging up still cancels it (its gateway says so); its gateway dying does
        not."""
        return self.background or (self.readable_later and not self.stream)

    def turn_input(self) -> list[ChatMessage]:
        """The messages a record keeps: a turn's new input only (its history is recorded already), else all."""
        if self.turn is None:
            return self.messages
        return self.messages[len(self.messages) - self.turn.input_count:]

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


class TokenDelta(Event):
    """v3: another request's non-final delta riding in a token record (``TokenEvent.more``)."""

    request_id: str
    attempt: int
    seq: int
    token_offset: int
    token_ids: list[int]
    text: str


class TokenEvent(Event):
    """One record of the token topic. Readers take its per-request events with :meth:`split`."""

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
    #: v2: why a stream ended in error, for the gateway's status and OpenAI error code (see ``ErrorCode``)
    error_code: str | None = None
    #: v3: the deltas of other requests of the same engine step to the same reply partition (``token_batch.py``)
    more: list[TokenDelta] = Field(default_factory=list)

    @property
    def is_final(self) -> bool:
        return self.finish_reason is not None

    def split(self) -> list[TokenEvent]:
        """The per-request events this record carries, in the order they were emitted."""
        if not self.more:
            return [self]
        shared = {"worker_id": self.worker_id, "emitted_at_us": self.emitted_at_us}
        return [self.model_copy(update={"more": []}),
                *(TokenEvent(**delta.model_dump(), **shared) for delta in self.more)]


class StoredCompletion(Event):
    """A finished completion its client asked to store: the request's messages and metadata, the text, the usage."""

    completion_id: str
    org_id: str
    key_id: str
    user: str | None = None
    model: str
    created_at: datetime
    messages: list[ChatMessage]
    metadata: dict[str, str] = Field(default_factory=dict)
    text: str
    finish_reason: str
    usage: TokenUsage
    error: str | None = None
    #: v2: whether it is listed among stored chat completions (``store: true`` on a chat completion; v1: always)
    listed: bool = True
    conversation_id: str | None = None
    #: v2: the turn it records (``messages`` then holds the turn's new input only)
    turn: Turn | None = None

    @classmethod
    def of(cls, request: ChatRequest, text: str, final: TokenEvent) -> StoredCompletion:
        """The record of a request that ended with ``final`` (by its worker, or refused before any)."""
        assert final.finish_reason is not None
        return cls(completion_id=request.request_id, org_id=request.org_id, key_id=request.key_id,
                   user=request.user, model=request.model, created_at=request.created_at,
                   messages=request.turn_input(), metadata=request.metadata, text=text,
                   finish_reason=final.finish_reason, usage=final.usage or TokenUsage(prompt_tokens=0,
                                                                                      completion_tokens=0),
                   error=final.error, listed=request.store, conversation_id=request.conversation_id,
                   turn=request.turn and request.turn.model_copy(update={
                       "temperature": request.sampling.temperature, "top_p": request.sampling.top_p}))


class ErrorCode(enum.StrEnum):
    """Machine-readable reasons a final token event carries with ``error`` (the gateway maps each to a status)."""

    QUEUE_DEADLINE_EXCEEDED = "queue_deadline_exceeded"
    GENERATION_FAILED = "generation_failed"
    TOKEN_DELIVERY_FAILED = "token_delivery_failed"
    STREAM_INCONSISTENT = "stream_inconsistent"
    UNDECODABLE_REQUEST = "undecodable_request"
    UNDECODABLE_EVENT = "undecodable_event"
    STREAM_TIMEOUT = "stream_timeout"
    GATEWAY_STOPPING = "gateway_stopping"


class ControlAction(enum.StrEnum):
    CANCEL = "CANCEL"
    HALT = "HALT"
    # Reader default for actions added by newer writers.
    UNKNOWN = "UNKNOWN"
    #: v3: a client connection now receives the stream (a resume), or went away (generation goes on for its window)
    ATTACH = "ATTACH"
    DETACH = "DETACH"


#: the accepting gateway's connection to a stream's client (a resume attaches one of its own id)
ORIGIN_ATTACHMENT = "0"


class ControlEvent(Event):
    request_id: str
    action: ControlAction
    reason: str
    issued_by: str
    issued_at: datetime
    #: v2, on a connection's cancel or detach: the completion tokens its client had received
    delivered_tokens: int | None = None
    #: v3: the client connection the event is about (``ORIGIN_ATTACHMENT``, or a resume's own id); None on a cancel
    #: no connection issued (the explicit cancel endpoint)
    attachment: str | None = None
    #: v3, on a detach: how long generation goes on for a client to resume with no connection attached
    window_s: float | None = None

    @property
    def stops(self) -> bool:
        """A cancel or a halt: generation stops (attach and detach only say who listens)."""
        return self.action in (ControlAction.CANCEL, ControlAction.HALT)


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


class RequestsRefused(Event):
    """Requests of one key one gateway refused at admission (429) since its last report for that key."""

    key_id: str
    org_id: str
    tier: str
    refused: int
    first_at: datetime
    last_at: datetime
    gateway_id: str


class BudgetAlert(Event):
    alert_id: str
    org_id: str
    month: str
    kind: str  # threshold | exhausted
    billed_usd: str
    budget_usd: str
    alert_fraction: float
    request_id: str
    raised_at: datetime


class LimitOverrides(Event):
    """An org's own limits; None: its tier's."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None


class OrgRecord(Event):
    org_id: str
    name: str
    tier: str
    limits: LimitOverrides = Field(default_factory=LimitOverrides)
    monthly_budget_micros: int | None = None
    budget_alert_fraction: float = 0.8
    created_at: datetime
    updated_at: datetime


class KeyRecord(Event):
    key_hash: str
    key_id: str
    org_id: str
    name: str
    admin: bool = False
    models: list[str] = Field(default_factory=list)
    expires_at: datetime | None = None
    revoked_at: datetime | None = None
    created_at: datetime

    def revoked_by(self, now: datetime) -> bool:
        return self.revoked_at is not None and self.revoked_at <= now

    def expired_by(self, now: datetime) -> bool:
        return self.expires_at is not None and self.expires_at <= now

    def usable_at(self, now: datetime) -> bool:
        return not self.revoked_by(now) and not self.expired_by(now)


def utcnow() -> datetime:
    return datetime.now(UTC)
