"""A synthetic engine: tokens at a fixed rate per request, no model. Same protocol as the vLLM engine.

Like a batching engine, it steps every running request at once: all of a step's tokens come out together, on a
fixed clock, which is what the worker's token records are shaped by. A new request's first token comes at the next
*prefill* step, on a clock of its own (every ``PREFILL_S`` at most): as a real engine schedules a new request's
prefill at its next step whatever the decode rate per request, so that a slow rate (idle-heavy streams) does not
make the time to first token a whole decode interval. Engines of a fleet do not step together: each synthetic
engine's clocks have a phase of their own (its worker's, ``engine_phase``), so N workers spread their steps over the
interval as N real engines would, instead of every worker's step landing on the relay at the same instant.

For measuring everything around the engine (Kafka, the worker's emitter, the gateway's relay) at loads no real
engine on this machine could produce, and for checking streams token by token under faults (``kns chaos``):
like a real model, each token is a function of what precedes it, so a generation continued from an emitted
prefix at temperature 0 equals an uninterrupted one, and a seeded sample at temperature > 0 is reproducible
only when it is generated again from the start. Never the default; selected with ``KNS_ENGINE__KIND=synthetic``.
"""

from __future__ import annotations

import asyncio
import math
import zlib
from collections.abc import AsyncGenerator, Sequence
from struct import pack

from inference_workers.protocol import EngineDelta
from runtime.settings import EngineSettings
from schemas.events import SamplingSpec

#: the longest a new request waits for its prefill step (its first token)
PREFILL_S = 0.02
#: token ids the synthetic model draws from; the text of token t is " t<t>"
VOCAB_BASE, VOCAB_SIZE = 1000, 4000
CONTEXT = 8


def next_token(context: Sequence[int], sampling: SamplingSpec, step: int) -> int:
    """The token after ``context``: greedy (a function of the context) at temperature 0; at temperature > 0 a
    draw from the request's seeded stream, which restarts with every generation, as a sampler's RNG does."""
    data = pack(f"<{min(len(context), CONTEXT)}i", *context[-CONTEXT:])
    if sampling.temperature > 0:
        data += pack("<qi", sampling.seed if sampling.seed is not None else id(sampling), step)
    return VOCAB_BASE + zlib.crc32(data) % VOCAB_SIZE


def token_text(token: int) -> str:
    return f" t{token}"


def expected_completion(prompt: Sequence[int], sampling: SamplingSpec) -> tuple[list[int], str]:
    """What an uninterrupted generation of the synthetic model gives (to check streams against)."""
    context, ids = list(prompt), []
    for step in range(sampling.max_tokens):
        token = next_token(context, sampling, step)
        ids.append(token)
        context.append(token)
    return ids, "".join(token_text(t) for t in ids)


def engine_phase(instance_id: str) -> float:
    """Where in its step interval a worker's engine steps, as a fraction of it: fixed per worker instance."""
    return zlib.crc32(instance_id.encode()) / 2**32


class StepClock:
    """The engine's steps: every waiting request is woken by the same tick, on a fixed grid of ``interval``
    shifted by ``phase`` (a fraction of the interval)."""

    def __init__(self, interval: float, phase: float = 0.0) -> None:
        self._interval = interval
        self._offset = (phase % 1.0) * interval
        #: a future per request waiting for the next tick (a request cancelled mid-wait cancels only its own, which
        #: a shared future under ``asyncio.shield`` also ensured, at twice the cost per waiter)
        self._waiters: list[asyncio.Future[None]] | None = None
        self._last = -math.inf

    async def next(self) -> None:
        loop = asyncio.get_running_loop()
        if self._waiters is None:
            at = (math.floor((loop.time() - self._offset) / self._interval) + 1) * self._interval + self._offset
            # A timer may fire a hair early: never schedule the tick that just fired again.
            at = max(at, self._last + self._interval)
            self._last = at
            self._waiters = []
            loop.call_at(at, self._tick, self._waiters)
        waiter = loop.create_future()
        self._waiters.append(waiter)
        await waiter

    def _tick(self, waiters: list[asyncio.Future[None]]) -> None:
        self._waiters = None
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)


class SyntheticEngine:
    def __init__(self, settings: EngineSettings, *, phase: float = 0.0) -> None:
        self._interval = 1.0 / settings.synthetic_tokens_per_s
        self._max_num_seqs = settings.synthetic_max_seqs
        self._steps = StepClock(self._interval, phase)
        self._prefills = StepClock(min(self._interval, PREFILL_S), phase)

    @property
    def max_num_seqs(self) -> int:
        return self._max_num_seqs

    @property
    def healthy(self) -> bool:
        return True

    def describe(self) -> dict[str, object]:
        return {"kind": "synthetic", "tokens_per_s_per_request": 1 / self._interval,
                "max_num_seqs": self._max_num_seqs}

    async def generate(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingSpec, *,
                       priority: int = 0) -> AsyncGenerator[EngineDelta, None]:
        prompt = len(prompt_token_ids)
        context = list(prompt_token_ids)
        for step in range(sampling.max_tokens):
            await (self._steps if step else self._prefills).next()
            token = next_token(context, sampling, step)
            context.append(token)
            last = step == sampling.max_tokens - 1
            yield EngineDelta([token], token_text(token), "length" if last else None, prompt, 0)

    def shutdown(self) -> None:
        return None
