"""``/tokenize`` and ``/detokenize``: the served model's tokenizer, as vLLM's server offers it, for clients that
count tokens before they send (a prompt's fit in the context, a budget) or read ids back as text.

The gateway's own tokenizer answers (the one that renders every chat completion's prompt), so a chat body's count
is the ``prompt_tokens`` its completion is billed. Nothing reaches Kafka or an engine, and nothing is billed; each
call takes one read of the key's read bucket (``Admission.admit_read``), before its body is parsed, so a key
tokenizing in a loop is throttled like one listing in a loop. Long inputs are tokenized in a thread, as prompts are.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

from producers.gateway.admission import Admission
from producers.gateway.errors import bad_request, model_not_allowed, model_not_found
from producers.gateway.prompt import INLINE_RENDER_CHARS, INLINE_RENDER_MESSAGES, PromptBuilder, to_event_messages
from producers.gateway.tokenize_protocol import Detokenize, Detokenized, TokenizeChat, Tokenized, TokenizePrompt
from runtime.metrics import GATEWAY_TOKENIZER
from runtime.tenancy import ApiKey

T = TypeVar("T")
#: ids decoded (or turned into token strings) on the event loop at most (under a µs each); more in a thread
INLINE_DECODE_IDS = 2000
#: bodies parsed on the event loop at most: a list of ids is validated item by item (about 0.15 µs a byte)
INLINE_PARSE_BYTES = 64 * 1024


class Tokenization:
    def __init__(self, prompts: PromptBuilder, admission: Admission) -> None:
        self._prompts = prompts
        self._admission = admission

    async def tokenize(self, key: ApiKey, parse: Callable[[], TokenizeChat | TokenizePrompt], *,
                       size: int = 0) -> Tokenized:
        """``size``: the body's bytes (a large one is parsed in a thread too)."""
        await self._admission.admit_read(key)
        body = await _run(parse, inline=size <= INLINE_PARSE_BYTES)
        self._check_model(body.model, key)
        if isinstance(body, TokenizeChat):
            inline = (len(body.messages) <= INLINE_RENDER_MESSAGES
                      and sum(len(m.text()) for m in body.messages) <= INLINE_RENDER_CHARS)
            ids = await _run(lambda: self._chat_ids(body), inline=inline)
        else:
            ids = await _run(lambda: self._prompts.encode(body.prompt, add_special_tokens=body.add_special_tokens),
                             inline=len(body.prompt) <= INLINE_RENDER_CHARS)
        strings = (await _run(lambda: self._prompts.token_strings(ids), inline=len(ids) <= INLINE_DECODE_IDS)
                   if body.return_token_strs else None)
        GATEWAY_TOKENIZER.labels(op="tokenize").inc()
        return Tokenized(count=len(ids), max_model_len=self._prompts.card.max_model_len, tokens=ids,
                         token_strs=strings)

    async def detokenize(self, key: ApiKey, parse: Callable[[], Detokenize], *, size: int = 0) -> Detokenized:
        """``size``: the body's bytes (a large one is parsed in a thread too)."""
        await self._admission.admit_read(key)
        body = await _run(parse, inline=size <= INLINE_PARSE_BYTES)
        self._check_model(body.model, key)
        text = await _run(lambda: self._decode(body.tokens), inline=len(body.tokens) <= INLINE_DECODE_IDS)
        GATEWAY_TOKENIZER.labels(op="detokenize").inc()
        return Detokenized(prompt=text)

    def _decode(self, ids: list[int]) -> str:
        size = self._prompts.vocabulary_size
        unknown = next((i for i in ids if i >= size), None)
        if unknown is not None:
            raise bad_request(f"Token id {unknown} is out of this model's vocabulary (ids 0 to {size - 1}).",
                              param="tokens", code="invalid_value")
        return self._prompts.decode(ids)

    def _check_model(self, model: str | None, key: ApiKey) -> None:
        """No model (null or empty, as vLLM's server reads it): the one served. A named one must be served, and
        allowed to the key."""
        if not model:
            return
        if model != self._prompts.card.served_name:
            raise model_not_found(model)
        if not key.allows_model(model):
            raise model_not_allowed(model)

    def _chat_ids(self, body: TokenizeChat) -> list[int]:
        messages = to_event_messages(body)
        if not body.add_special_tokens:  # exactly a chat completion's prompt, with the defaults
            return self._prompts.render(messages, add_generation_prompt=body.add_generation_prompt,
                                        continue_final_message=body.continue_final_message)
        text = self._prompts.render_text(messages, add_generation_prompt=body.add_generation_prompt,
                                         continue_final_message=body.continue_final_message)
        return self._prompts.encode(text, add_special_tokens=True)


async def _run(work: Callable[[], T], *, inline: bool) -> T:
    return work() if inline else await asyncio.to_thread(work)
