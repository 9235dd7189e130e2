"""Bodies of ``POST /tokenize`` and ``POST /detokenize``, as vLLM's server takes and answers them.

Strict as every request model here (``protocol.py``): a field of another type, or one vLLM takes that this server does
not act on (``chat_template``, ``tools``, media kwargs), is a 400 naming it.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, RootModel, model_validator

from producers.gateway.protocol import INT32_MAX, INTEGRAL, MAX_MODEL_CHARS, ChatMessageIn

ModelName = Annotated[str, Field(max_length=MAX_MODEL_CHARS)]


class TokenizeChat(BaseModel):
    """Chat messages, rendered with the model's chat template as a chat completion's prompt is."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: ModelName | None = None
    messages: Annotated[list[ChatMessageIn], Field(min_length=1)]
    #: the assistant's turn opened at the end, as a chat completion's prompt has it
    add_generation_prompt: bool = True
    #: the last message left open for the model to continue (instead of a new turn)
    continue_final_message: bool = False
    #: special tokens on top of the template's own (which adds them itself)
    add_special_tokens: bool = False
    return_token_strs: bool | None = False

    @model_validator(mode="after")
    def _one_ending(self) -> TokenizeChat:
        """Continuing the final message opens no new turn: ``add_generation_prompt`` is then false unless the body
        says true, which contradicts it."""
        if self.continue_final_message and self.add_generation_prompt:
            if "add_generation_prompt" in self.model_fields_set:
                raise ValueError("'continue_final_message' and 'add_generation_prompt' cannot both be true; set "
                                 "'add_generation_prompt' to false to continue the final message")
            self.add_generation_prompt = False
        return self


class TokenizePrompt(BaseModel):
    """A plain text prompt."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: ModelName | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeBody(RootModel[TokenizeChat | TokenizePrompt]):
    """Either form: a body with ``messages`` is a chat, any other a prompt (so that an error names the form's
    fields, not both forms')."""

    @model_validator(mode="wrap")
    @classmethod
    def _by_messages(cls, data: Any, handler: Any) -> Any:
        if isinstance(data, dict):
            form: type[TokenizeChat | TokenizePrompt] = TokenizeChat if "messages" in data else TokenizePrompt
            return cls.model_construct(root=form.model_validate(data))
        return handler(data)


class Detokenize(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    model: ModelName | None = None
    #: ids the model's vocabulary has (one it lacks is a 400 naming it)
    tokens: list[Annotated[int, Field(ge=0, le=INT32_MAX), INTEGRAL]]


class Tokenized(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    #: each token's string (byte-level BPE pieces as the tokenizer writes them); null unless asked for
    token_strs: list[str] | None = None


class Detokenized(BaseModel):
    prompt: str
