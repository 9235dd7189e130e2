"""The worker's seams. Only ``engine.py`` imports vLLM; everything else depends on :class:`EngineClient`, so the
intake, offsets, rebalance and control logic is unit-tested with a fake engine (``tests/fakes/``) and
integration-tested with vLLM. The other Protocols are the Kafka- and Redis-facing parts the intake uses, faked in
the same unit tests and real everywhere else.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from aiokafka import TopicPartition

from schemas.events import ChatRequest, SamplingSpec, TokenEvent
from schemas.token_batch import Delta

if TYPE_CHECKING:
    from inference_workers.claims import Claim
    from inference_workers.emitter import Delivery, Finished
    from inference_workers.resume import EmittedPrefix


@dataclass(frozen=True)
class EngineDelta:
    """New output of one request since the previous delta (may hold several tokens, or none)."""

    token_ids: list[int]
    text: str
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int


class EngineDeadError(Exception):
    """The engine process died: the worker cannot serve and must exit non-zero."""


class EngineClient(Protocol):
    @property
    def max_num_seqs(self) -> int:
        """How many requests the engine batches at once; the worker never admits more."""
        ...

    def generate(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingSpec, *,
                 priority: int = 0) -> AsyncGenerator[EngineDelta, None]:
        """Stream deltas until one carries a finish reason. Cancelling the iterating task aborts the request
        in the engine. ``priority``: its class's rank (0 highest), for an engine that schedules by priority."""
        ...

    @property
    def healthy(self) -> bool: ...

    def describe(self) -> dict[str, object]: ...

    def shutdown(self) -> None: ...


# --- the worker's other seams (faked in unit tests: tests/fakes/) ------------------------------------------


class ClaimsT(Protocol):
    """Who generates a request id (``claims.RequestClaims``)."""

    async def claim(self, request_id: str, source: str, attempt: int, *, org_id: str = "", key_id: str = ""
                    ) -> Claim: ...

    async def record_first_offset(self, request_id: str, offset: int) -> None: ...

    async def first_offset(self, request_id: str) -> int | None: ...

    async def mark_done(self, request_ids: list[str]) -> None: ...


class SettlementsT(Protocol):
    """Where the rate limiter learns what a finalized request used (``runtime.limiter.RateLimiter``)."""

    async def settle_many(self, used: list[tuple[str, int, bool]]) -> int:
        """(request id, tokens used, billed) each."""
        ...


class TokenSinkT(Protocol):
    """Produces a request's non-final token events (``token_sink.TokenSink``)."""

    async def emit(self, event: TokenEvent | Delta, partition: int, traceparent: str | None) -> Delivery: ...


class FinalizerT(Protocol):
    """Commits finished requests with their offsets (``emitter.Finalizer``)."""

    async def finish(self, item: Finished) -> None: ...

    def commit_offsets_soon(self, tp: TopicPartition) -> None: ...

    async def flush(self, timeout_s: float | None = None) -> None: ...


class PrefixReaderT(Protocol):
    """Reads what a request emitted so far (``prefix.PrefixReader``)."""

    async def read(self, request: ChatRequest, first_offset: int | None) -> EmittedPrefix: ...
