"""The vLLM engine adapter (``inference_workers/engine.py``) on the real vLLM engine and the served model: a takeover's
continuation, whose prompt ends with emitted tokens that stop inside a character, streams the text those tokens and
its own add up to, not vLLM's first text then (the whole prompt's, ``continuation_text.py``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from tokenizers import Tokenizer

from inference_workers.engine import VllmEngine
from runtime.settings import Settings
from schemas.events import SamplingSpec

#: the served model answers it greedily with Chinese and emoji: characters of three and four bytes, split over tokens
QUESTION = "Say hello in Chinese, Japanese and Korean."
MAX_TOKENS = 24


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def engine(settings: Settings) -> AsyncIterator[VllmEngine]:
    started = await asyncio.to_thread(VllmEngine.start, settings.model, settings.engine)
    yield started
    started.shutdown()


async def _deltas(engine: VllmEngine, request_id: str, prompt: list[int], max_tokens: int
                  ) -> list[tuple[list[int], str]]:
    return [(d.token_ids, d.text) async for d in engine.generate(request_id, prompt, SamplingSpec(
        max_tokens=max_tokens, temperature=0))]


@pytest.mark.timeout(600)  # the engine's start on a CPU
async def test_a_continuation_from_tokens_that_end_inside_a_character_streams_only_the_text_they_add(
        engine: VllmEngine, settings: Settings) -> None:
    tokenizer = Tokenizer.from_file(str(settings.model.path / "tokenizer.json"))
    prompt = tokenizer.encode(f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n",
                              add_special_tokens=False).ids
    whole = await _deltas(engine, "whole", prompt, MAX_TOKENS)
    # Where a takeover can continue from: after a delta (what was emitted), inside a character.
    cuts, emitted_ids, emitted_text = [], [], ""
    for ids, text in whole[:-1]:
        emitted_ids, emitted_text = emitted_ids + ids, emitted_text + text
        if tokenizer.decode(emitted_ids, skip_special_tokens=True).endswith("\ufffd"):
            cuts.append((list(emitted_ids), emitted_text))
    assert cuts, f"the model's answer splits no character over tokens: {''.join(t for _, t in whole)!r}"

    for n, (ids, text) in enumerate(cuts[:3]):
        continuation = await _deltas(engine, f"continued-{n}", prompt + ids, MAX_TOKENS - len(ids))
        added_ids = [t for delta_ids, _ in continuation for t in delta_ids]
        added_text = "".join(t for _, t in continuation)
        # What the client has: the emitted text, then the continuation's; all of it the decode of the tokens it got
        # (a character the last token leaves unfinished is never streamed).
        received = tokenizer.decode(ids + added_ids, skip_special_tokens=True).rstrip("\ufffd")
        assert text + added_text == received, f"after {len(ids)} tokens: {added_text!r}"
