"""The worker's view of an inference engine. Only ``engine.py`` imports vLLM; everything else depends on this
Protocol, so the intake and emitter logic is unit-tested with a fake engine and integration-tested with vLLM.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from schemas.events import SamplingSpec


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

    def generate(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingSpec
                 ) -> AsyncIterator[EngineDelta]:
        """Stream deltas until one carries a finish reason. Cancelling the iterating task aborts the request
        in the engine."""
        ...

    @property
    def healthy(self) -> bool: ...

    def describe(self) -> dict[str, object]: ...

    def shutdown(self) -> None: ...
