"""OpenAI wire models for ``/v1/chat/completions`` (with vLLM's sampling extensions) and ``/v1/models``.

Requests are validated here (types and ranges); rules that need the tokenizer or the model card (context
length) live in ``prompt.py``. Unknown fields are accepted and logged, as OpenAI's API and vLLM do.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

ALLOWED_ROLES = ("system", "developer", "user", "assistant")


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[TextPart]
    name: str | None = None

    @field_validator("role")
    @classmethod
    def _known_role(cls, role: str) -> str:
        if role not in ALLOWED_ROLES:
            raise ValueError(f"unknown role {role!r}; expected one of {', '.join(ALLOWED_ROLES)}")
        return role

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    messages: Annotated[list[ChatMessageIn], Field(min_length=1)]
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    n: Annotated[int, Field(ge=1, le=1)] = 1
    seed: int | None = None
    stop: str | Annotated[list[str], Field(max_length=4)] | None = None
    user: str | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    # vLLM's sampling extensions, so that `vllm bench serve` runs unchanged
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0)] = 0
    top_k: int | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = None
    # ours: turns of one conversation share a partition (and a worker's prefix cache)
    conversation_id: Annotated[str, Field(min_length=1, max_length=128)] | None = None

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int | None) -> int | None:
        if value is not None and value < -1:
            raise ValueError("top_k must be -1 (disabled), 0 (disabled) or a positive integer")
        return value

    @model_validator(mode="after")
    def _coherent(self) -> ChatCompletionRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def unknown_fields(self) -> list[str]:
        return sorted((self.model_extra or {}).keys())


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    usage: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return usage
