"""A fake engine behind ``inference_workers.protocol.EngineClient``: the synthetic model's tokens, one per step,
each step released by the test (``step``) or free-running (``auto``), so races are driven deterministically."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

from inference_workers.protocol import EngineDelta
from inference_workers.synthetic import next_token, token_text
from schemas.events import SamplingSpec


@dataclass
class Generation:
    request_id: str
    prompt: list[int]
    sampling: SamplingSpec
    emitted: list[int] = field(default_factory=list)
    aborted: bool = False
    finished: bool = False


class FakeEngine:
    def __init__(self, max_num_seqs: int = 8, *, auto: bool = True, stop_at: int | None = None) -> None:
        self._max = max_num_seqs
        self.auto = auto
        #: the token id that ends a generation with "stop" (as an EOS would), if any
        self.stop_at = stop_at
        self.generations: list[Generation] = []
        self._steps: dict[str, asyncio.Semaphore] = {}
        self.fail_with: Exception | None = None

    @property
    def max_num_seqs(self) -> int:
        return self._max

    @property
    def healthy(self) -> bool:
        return True

    def describe(self) -> dict[str, object]:
        return {"kind": "fake"}

    def shutdown(self) -> None:
        return None

    def step(self, request_id: str, n: int = 1) -> None:
        """Let a (manually stepped) generation produce ``n`` more tokens."""
        gate = self._steps.setdefault(request_id, asyncio.Semaphore(0))
        for _ in range(n):
            gate.release()

    def served(self) -> list[Generation]:
        """The generations that produced a token or still run: not a head start the worker gave the engine before
        the request's claim came back and aborted, on the claim's verdict, before its first token."""
        return [g for g in self.generations if g.emitted or not g.aborted]

    def generation(self, request_id: str) -> Generation:
        return next(g for g in reversed(self.generations) if g.request_id.split("#")[0] == request_id)

    async def generate(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingSpec, *,
                       priority: int = 0) -> AsyncGenerator[EngineDelta, None]:
        gen = Generation(request_id, list(prompt_token_ids), sampling)
        self.generations.append(gen)
        if self.fail_with is not None:
            raise self.fail_with
        gate = self._steps.setdefault(request_id.split("#")[0], asyncio.Semaphore(0))
        context = list(prompt_token_ids)
        try:
            for index in range(sampling.max_tokens):
                if self.auto:
                    await asyncio.sleep(0)
                else:
                    await gate.acquire()
                token = next_token(context, sampling, index)
                context.append(token)
                gen.emitted.append(token)
                finish = "stop" if token == self.stop_at else "length" if index == sampling.max_tokens - 1 else None
                yield EngineDelta([token], token_text(token), finish, len(prompt_token_ids), 0)
                if finish:
                    gen.finished = True
                    return
        except (asyncio.CancelledError, GeneratorExit):
            gen.aborted = True
            raise
