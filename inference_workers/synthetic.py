"""A synthetic engine: tokens at a fixed rate per request, no model. Same protocol as the vLLM engine.

For measuring everything around the engine (Kafka, the worker's emitter, the gateway's relay) at loads no real
engine on this machine could produce. Never the default; selected with ``KNS_ENGINE__KIND=synthetic``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from inference_workers.protocol import EngineDelta
from runtime.settings import EngineSettings
from schemas.events import SamplingSpec

WORD = " tok"


class SyntheticEngine:
    def __init__(self, settings: EngineSettings) -> None:
        self._interval = 1.0 / settings.synthetic_tokens_per_s
        self._max_num_seqs = settings.synthetic_max_seqs

    @property
    def max_num_seqs(self) -> int:
        return self._max_num_seqs

    @property
    def healthy(self) -> bool:
        return True

    def describe(self) -> dict[str, object]:
        return {"kind": "synthetic", "tokens_per_s_per_request": 1 / self._interval,
                "max_num_seqs": self._max_num_seqs}

    async def generate(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingSpec
                       ) -> AsyncIterator[EngineDelta]:
        prompt = len(prompt_token_ids)
        for i in range(sampling.max_tokens):
            await asyncio.sleep(self._interval)
            last = i == sampling.max_tokens - 1
            yield EngineDelta([1000 + i % 100], WORD, "length" if last else None, prompt, 0)

    def shutdown(self) -> None:
        return None
