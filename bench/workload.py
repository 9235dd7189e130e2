"""Seeded workloads: what to ask, how long the answers are, and when requests arrive.

Two prompt-length mixes: ``sharegpt`` (log-normal prompt and output lengths, the shape of ShareGPT conversations,
clipped to the context) and ``fixed``. Prompts are built from a fixed vocabulary so both servers see byte-identical
requests; lengths are in words (about 1.3 tokens each for this tokenizer), outputs in tokens (``max_tokens``, with
``ignore_eos`` so every server generates exactly that many).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

Dataset = Literal["sharegpt", "fixed"]

_WORDS = [
    "the", "system", "stream", "event", "token", "kafka", "model", "request", "answer", "river", "mountain",
    "light", "garden", "data", "signal", "history", "ocean", "music", "city", "engine", "travel", "question",
    "summer", "winter", "market", "story", "window", "forest", "paper",
]


class WorkloadError(ValueError):
    """Arguments that make no workload: the message says which and why."""


@dataclass(frozen=True)
class Shape:
    dataset: Dataset = "sharegpt"
    requests: int = 64
    input_words: int = 128
    output_tokens: int = 128
    seed: int = 0
    max_context: int = 2048

    def validate(self) -> None:
        if self.requests < 1:
            raise WorkloadError("--requests must be at least 1")
        if not 1 <= self.input_words <= self.max_context:
            raise WorkloadError(f"--input-len must be between 1 and {self.max_context} words")
        if not 1 <= self.output_tokens <= self.max_context:
            raise WorkloadError(f"--output-len must be between 1 and {self.max_context} tokens")
        if self.input_words * 1.4 + self.output_tokens > self.max_context:
            approx = int(self.input_words * 1.4)
            raise WorkloadError(f"--input-len ({self.input_words} words ≈ {approx} tokens) plus --output-len "
                                f"({self.output_tokens}) does not fit the {self.max_context}-token context")


@dataclass(frozen=True)
class Item:
    index: int
    prompt: str
    max_tokens: int


def _lognormal(rng: random.Random, median: float, sigma: float, low: int, high: int) -> int:
    return max(low, min(high, round(math.exp(rng.gauss(math.log(median), sigma)))))


def items(shape: Shape) -> list[Item]:
    """The same list for the same shape, on every machine."""
    shape.validate()
    rng = random.Random(shape.seed)
    out = []
    for i in range(shape.requests):
        if shape.dataset == "fixed":
            words, tokens = shape.input_words, shape.output_tokens
        else:
            words = _lognormal(rng, shape.input_words, 0.8, 4, shape.max_context // 3)
            tokens = _lognormal(rng, shape.output_tokens, 0.7, 4, shape.max_context // 3)
        body = " ".join(rng.choice(_WORDS) for _ in range(max(1, words - 6)))
        # the seed first: prompts of two seeds part right after the chat template's system prompt (a shared 16-token
        # block would be answered from the prefix cache)
        out.append(Item(i, f"Set {shape.seed}, request {i}. Continue this text: {body}", tokens))
    return out


def arrivals(rate: float | None, seed: int) -> Iterator[float]:
    """Gaps between request starts: Poisson at ``rate`` per second, or none (fixed concurrency)."""
    rng = random.Random(seed + 1)
    while True:
        yield rng.expovariate(rate) if rate else 0.0
