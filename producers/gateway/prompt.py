"""From OpenAI messages to engine input: chat template, tokenization, and the context-length rules.

The gateway tokenizes (not the worker) so that it can reject a prompt that does not fit the context before
anything reaches Kafka, and so that the request event carries exactly the token ids the engine will see.
Tokenizing is CPU work: :meth:`PromptBuilder.tokens` runs it in a thread unless the messages are short.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from producers.gateway.errors import bad_request
from producers.gateway.protocol import ChatCompletionRequest, ChatMessageIn
from runtime.metrics import GATEWAY_PROMPT
from runtime.settings import ModelSettings
from schemas.events import ChatMessage, SamplingSpec

#: at most this many messages of at most this many characters in all are rendered on the event loop (about 1 ms
#: of CPU at most); anything larger in a thread
INLINE_RENDER_CHARS = 2000
INLINE_RENDER_MESSAGES = 16


@dataclass(frozen=True)
class ModelCard:
    served_name: str
    max_model_len: int
    owned_by: str
    created: int = field(default_factory=lambda: int(time.time()))

    def as_openai(self) -> dict[str, Any]:
        return {
            "id": self.served_name,
            "object": "model",
            "created": self.created,
            "owned_by": self.owned_by,
            "root": self.served_name,
            "parent": None,
            "max_model_len": self.max_model_len,
            "context_length": self.max_model_len,
        }


class WithMessages(Protocol):
    """A body with chat messages (a chat completion, a ``/tokenize`` chat)."""

    @property
    def messages(self) -> list[ChatMessageIn]: ...


def to_event_messages(request: WithMessages) -> list[ChatMessage]:
    # "developer" is OpenAI's newer name for the system role; the chat template knows "system".
    return [
        ChatMessage(role="system" if m.role == "developer" else m.role, content=m.text(), name=m.name)
        for m in request.messages
    ]


class PromptBuilder:
    def __init__(self, tokenizer: Any, card: ModelCard) -> None:
        self._tokenizer = tokenizer
        self.card = card

    @classmethod
    async def load(cls, model: ModelSettings) -> PromptBuilder:
        def _load() -> Any:
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(str(model.path), local_files_only=True)

        tokenizer = await asyncio.to_thread(_load)
        return cls(tokenizer, ModelCard(model.served_name, model.max_model_len, model.owned_by))

    async def tokens(self, messages: list[ChatMessage]) -> list[int]:
        """The prompt's token ids: rendered on the event loop when the messages are short, in a thread when not.

        A thread hand-off costs the loop about as much as rendering a short prompt (0.2 ms for a one-line message
        here, about 0.4 µs per character and 30 µs per message more) and then contends with it for the GIL; a long
        prompt, or a long list of messages, would stall every stream of the loop for milliseconds."""
        started = time.perf_counter()
        if len(messages) <= INLINE_RENDER_MESSAGES and sum(len(m.content) for m in messages) <= INLINE_RENDER_CHARS:
            ids = self.render(messages)
        else:
            ids = await asyncio.to_thread(self.render, messages)
        GATEWAY_PROMPT.observe(time.perf_counter() - started)
        return ids

    def render(self, messages: list[ChatMessage], *, add_generation_prompt: bool = True,
               continue_final_message: bool = False) -> list[int]:
        """Blocking: apply the chat template and tokenize (a chat completion's prompt: the defaults)."""
        encoded = self._tokenizer.apply_chat_template(
            [{"role": m.role, "content": m.content} for m in messages],
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=True,
        )
        ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
        return [int(i) for i in ids]

    # --- the tokenizer as such (``/tokenize``, ``/detokenize``) -------------------------------------------

    @property
    def vocabulary_size(self) -> int:
        """Ids ``0 .. vocabulary_size - 1`` are tokens of the model (added tokens included)."""
        return len(self._tokenizer)

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        """Blocking: a plain text's token ids."""
        return [int(i) for i in self._tokenizer.encode(text, add_special_tokens=add_special_tokens)]

    def render_text(self, messages: list[ChatMessage], *, add_generation_prompt: bool,
                    continue_final_message: bool) -> str:
        """Blocking: the chat template's text, untokenized."""
        return str(self._tokenizer.apply_chat_template(
            [{"role": m.role, "content": m.content} for m in messages],
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=False,
        ))

    def token_strings(self, ids: list[int]) -> list[str]:
        return [str(t) for t in self._tokenizer.convert_ids_to_tokens(ids)]

    def decode(self, ids: list[int]) -> str:
        """Blocking: the text of token ids, special tokens included (as vLLM's ``/detokenize``)."""
        return str(self._tokenizer.decode(ids))

    def sampling(self, request: ChatCompletionRequest, prompt_tokens: int, *,
                 json_schema: str | None = None) -> SamplingSpec:
        """The sampling spec, or a 400 when the prompt and the completion cannot fit the context or a biased token
        is not the model's. ``json_schema``: the checked structured output (``structured.SchemaChecker``)."""
        limit = self.card.max_model_len
        if prompt_tokens >= limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, your messages resulted in "
                f"{prompt_tokens} tokens. Please reduce the length of the messages.",
                param="messages", code="context_length_exceeded",
            )
        requested = request.requested_max_tokens
        param = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
        if requested is not None and prompt_tokens + requested > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_tokens + requested} tokens ({prompt_tokens} in the messages, {requested} in the "
                "completion). Please reduce the length of the messages or completion.",
                param=param, code="context_length_exceeded",
            )
        max_tokens = requested if requested is not None else limit - prompt_tokens
        if request.min_tokens > max_tokens:
            raise bad_request(
                f"min_tokens ({request.min_tokens}) must not exceed max_tokens ({max_tokens}).",
                param="min_tokens", code="invalid_value",
            )
        temperature = 1.0 if request.temperature is None else request.temperature
        return SamplingSpec(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=1.0 if request.top_p is None else request.top_p,
            top_k=max(0, request.top_k or 0),
            min_tokens=request.min_tokens,
            seed=replayable_seed(request.seed, temperature, json_schema),
            stop=request.stop_list,
            ignore_eos=request.ignore_eos,
            repetition_penalty=request.repetition_penalty or 1.0,
            presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty,
            json_schema=json_schema,
            logit_bias=self._logit_bias(request.logit_bias),
        )

    def _logit_bias(self, biases: dict[str, float] | None) -> dict[str, float]:
        """A 400 naming a token id the model does not have: the engine would fail the accepted request."""
        vocabulary = self.vocabulary_size
        for token in biases or {}:
            if int(token) >= vocabulary:
                raise bad_request(f"Invalid key in 'logit_bias': {token}. Token ids must be below the model's "
                                  f"vocabulary size, {vocabulary}.", param="logit_bias", code="invalid_value")
        return dict(biases or {})


#: the seed vLLM reads as none (it samples from the global generator)
UNSEEDED = -1


def replayable_seed(seed: int | None, temperature: float, json_schema: str | None) -> int | None:
    """A structured output is taken over by replaying it from its prompt (its grammar cannot be entered half-way,
    ``inference_workers/resume.py``): a sample is replayed exactly only with its seed, so one without gets a random
    one here, kept in the request for every attempt. A seed of -1 is none to vLLM (``SamplingParams``), so it gets one
    too."""
    if json_schema is None or temperature == 0 or seed not in (None, UNSEEDED):
        return seed
    return secrets.randbits(63)
