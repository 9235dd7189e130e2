"""A fake engine behind ``inference_workers.protocol.EngineClient``: the synthetic model's tokens, one per step,
each step released by the test (``step``) or free-running (``auto``), so races are driven deterministically.

By default every delta is one token whose text is a function of that token alone (``synthetic.token_text``). What a
real engine does too, each on request:

* ``tokenizer``: text as ``VllmEngine`` gives it: vLLM's detokenizer's (``vllm/v1/engine/detokenizer.py``,
  FastIncrementalDetokenizer: the model's tokenizer's ``DecodeStream``, primed with the prompt), where a character
  split over several tokens comes out with its last token and the tokens before it have no text of their own; and
  the adapter's own (``continuation_text.py``) for a prompt that ends inside a character;
* ``answer``: a model that answers these token ids (say, a text encoded with the tokenizer) to every prompt, as a
  function of the context, so a generation continued from an emitted prefix goes on where the prefix ends; the
  answer's end is the model's end of sequence (finish reason "stop");
* ``tokens_per_delta``: several tokens per delta (speculative decoding, or vLLM's output collector merging the
  deltas of a request its reader was slow to take);
* ``fail_with`` with ``fail_after``: the generation raises after that many tokens (0: before the first, as a request
  the engine rejects; more: an engine that fails mid-stream, or dies with ``EngineDeadError``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from inference_workers.continuation_text import ContinuationText
from inference_workers.protocol import EngineDelta
from inference_workers.synthetic import next_token, token_text
from schemas.events import SamplingSpec

#: tokenizers' message for a decode stream whose primed text is not a prefix of the next decode (vLLM resets then)
_INVALID_PREFIX = "Invalid prefix encountered"


@dataclass
class Generation:
    request_id: str
    prompt: list[int]
    sampling: SamplingSpec
    emitted: list[int] = field(default_factory=list)
    aborted: bool = False
    finished: bool = False


@cache
def model_tokenizer() -> Any:
    """The served model's ``tokenizers.Tokenizer``, from its local folder: what vLLM's detokenizer steps (the fast
    tokenizer transformers loads, as the gateway does in ``prompt.py``, wraps the same file; loaded without
    transformers, which takes seconds to import)."""
    from tokenizers import Tokenizer

    from runtime.settings import ModelSettings

    return Tokenizer.from_file(str(ModelSettings().path / "tokenizer.json"))


class VllmDetokenizer:
    """vLLM's FastIncrementalDetokenizer without stop strings: the text each new token adds, primed with the prompt."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int]) -> None:
        from tokenizers.decoders import DecodeStream

        self._tokenizer = tokenizer
        self._new_stream = lambda **primed: DecodeStream(skip_special_tokens=True, **primed)
        self._stream = self._new_stream(ids=prompt_token_ids)

    def text(self, token_ids: Sequence[int]) -> str:
        return "".join(self._step(token) for token in token_ids)

    def _step(self, token: int) -> str:
        try:
            return self._stream.step(self._tokenizer, token) or ""
        except Exception as exc:  # what vLLM's _protected_step recovers from, the same way
            if not str(exc).startswith(_INVALID_PREFIX):
                raise
            self._stream = self._new_stream()
            return self._stream.step(self._tokenizer, token) or ""


def answer_position(context: Sequence[int], answer: Sequence[int]) -> int:
    """How much of ``answer`` the context already ends with: where a model that answers it goes on."""
    return max(k for k in range(len(answer) + 1) if list(context[len(context) - k:]) == list(answer[:k]))


class FakeEngine:
    def __init__(self, max_num_seqs: int = 8, *, auto: bool = True, stop_at: int | None = None,
                 tokenizer: Any = None, answer: Sequence[int] | None = None, tokens_per_delta: int = 1) -> None:
        self._max = max_num_seqs
        self.auto = auto
        #: the token id that ends a generation with "stop" (as an EOS would), if any
        self.stop_at = stop_at
        self.tokenizer = tokenizer
        self.answer = list(answer) if answer is not None else None
        self.tokens_per_delta = tokens_per_delta
        self.generations: list[Generation] = []
        self._steps: dict[str, asyncio.Semaphore] = {}
        self.fail_with: Exception | None = None
        #: tokens a generation yields before it raises ``fail_with``
        self.fail_after = 0

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

    def _next(self, context: list[int], sampling: SamplingSpec, index: int) -> int | None:
        """The next token; None: the model's end of sequence."""
        if self.answer is None:
            return next_token(context, sampling, index)
        at = answer_position(context, self.answer)
        return self.answer[at] if at < len(self.answer) else None

    def _detokenizer(self, prompt_token_ids: list[int], sampling: SamplingSpec
                     ) -> VllmDetokenizer | ContinuationText | None:
        """As ``VllmEngine.generate`` makes its text (None: the synthetic model's text)."""
        if self.tokenizer is None:
            return None
        own = None if sampling.stop else ContinuationText.for_prompt(self.tokenizer, prompt_token_ids)
        return own or VllmDetokenizer(self.tokenizer, prompt_token_ids)

    async def generate(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingSpec, *,
                       priority: int = 0) -> AsyncGenerator[EngineDelta, None]:
        gen = Generation(request_id, list(prompt_token_ids), sampling)
        self.generations.append(gen)
        if self.fail_with is not None and self.fail_after == 0:
            raise self.fail_with
        gate = self._steps.setdefault(request_id.split("#")[0], asyncio.Semaphore(0))
        context = list(prompt_token_ids)
        detokenizer = self._detokenizer(prompt_token_ids, sampling)
        ids: list[int] = []
        text = ""
        try:
            for index in range(sampling.max_tokens):
                if self.auto:
                    await asyncio.sleep(0)
                else:
                    await gate.acquire()
                token = self._next(context, sampling, index)
                if token is None:  # the answer's end: a stop (an end-of-sequence token, which this fake leaves out)
                    gen.finished = True
                    yield EngineDelta(ids, text, "stop", len(prompt_token_ids), 0)
                    return
                context.append(token)
                gen.emitted.append(token)
                ids.append(token)
                text += detokenizer.text([token]) if detokenizer is not None else token_text(token)
                finish = "stop" if token == self.stop_at else "length" if index == sampling.max_tokens - 1 else None
                if finish or len(ids) == self.tokens_per_delta:
                    yield EngineDelta(ids, text, finish, len(prompt_token_ids), 0)
                    ids, text = [], ""
                if finish:
                    gen.finished = True
                    return
                if self.fail_with is not None and len(gen.emitted) == self.fail_after:
                    raise self.fail_with
        except (asyncio.CancelledError, GeneratorExit):
            gen.aborted = True
            raise
