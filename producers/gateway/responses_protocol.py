"""OpenAI wire models of ``/v1/responses`` and ``/v1/conversations``: the request bodies and the objects answered.

As for chat completions, nothing a client sends is silently ignored, at any depth: an OpenAI parameter this server
does not implement is refused naming it unless its value asks for nothing (:data:`UNSUPPORTED_RESPONSES`, and
:data:`UNSUPPORTED_PART` for what an echoed output part carries), an unknown field gets "Unrecognized request
argument", and input items other than messages (tool calls and outputs, files, images) and content parts other than
text get a 400 naming their type. Free text that is not rendered (``user``, an echoed item's ``id``) is bounded; the
items of a created conversation are bounded where they are admitted (``conversations.py``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Annotated, Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from producers.gateway.protocol import (
    INTEGRAL,
    MAX_MODEL_CHARS,
    MAX_SCHEMA_DESCRIPTION_CHARS,
    MAX_USER_CHARS,
    SCHEMA_NAME,
    MetadataKey,
    MetadataValue,
    Unsupported,
    declare_unsupported,
    refuse_unsupported,
    unsupported_value,
)
from schemas.events import ChatMessage

#: Responses API parameters this server does not implement (openai-python's ``ResponseCreateParams``), with the
#: values that ask for nothing
UNSUPPORTED_RESPONSES: dict[str, Unsupported] = {
    "tools": Unsupported((None, [])),
    "tool_choice": Unsupported((None, "none", "auto")),
    "parallel_tool_calls": Unsupported((None, True, False)),
    "max_tool_calls": Unsupported(),
    "reasoning": Unsupported((None, {}, {"effort": None})),
    "include": Unsupported((None, [])),
    "top_logprobs": Unsupported((None, 0)),
    "prompt": Unsupported(),
    "service_tier": Unsupported((None, "auto", "default")),
    "stream_options": Unsupported((None, {}, {"include_obfuscation": False})),
    "prompt_cache_key": Unsupported(hint="Turns of a conversation share a worker's prefix cache already."),
    "prompt_cache_retention": Unsupported(),
    "safety_identifier": Unsupported(hint="Use user to identify the end user."),
    "context_management": Unsupported(),
}

ROLES = ("user", "assistant", "system", "developer")


#: What an output text part echoed back as input carries besides its text (``response.output`` reused as input)
UNSUPPORTED_PART: dict[str, Unsupported] = {"annotations": Unsupported((None, [])), "logprobs": Unsupported((None, []))}
PART_TYPES = ("input_text", "output_text", "text")
ID_CHARS = 128


class ContentPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid",
                              json_schema_extra=lambda schema: declare_unsupported(schema, UNSUPPORTED_PART))

    type: Literal["input_text", "output_text", "text"]
    text: str

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("type"), str) and data["type"] not in PART_TYPES:
            raise unsupported_value("Content parts", data["type"], "type", "input_text and output_text are")
        return refuse_unsupported(data, UNSUPPORTED_PART)


class InputMessage(BaseModel):
    """An input item: a message (the only item type served; ``id`` and ``status`` of an echoed item are allowed)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]
    id: Annotated[str, Field(min_length=1, max_length=ID_CHARS)] | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    @model_validator(mode="before")
    @classmethod
    def _messages_only(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type", "message") != "message":
            raise unsupported_value("Input items", data.get("type"), "type", "messages are")
        return data

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def as_event(self) -> ChatMessage:
        # "developer" is OpenAI's newer name for the system role; the chat template knows "system"
        return ChatMessage(role="system" if self.role == "developer" else self.role, content=self.text())


class ConversationRef(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    id: Annotated[str, Field(min_length=1, max_length=128)]


Metadata = Annotated[dict[MetadataKey, MetadataValue], Field(max_length=16)]


#: the fields of a ``json_schema`` text format, which no other type takes
SCHEMA_FIELDS = ("name", "description", "schema", "strict")


def _declare_text_format_rule(schema: dict[str, Any]) -> None:
    """What JSON Schema can say of :class:`TextFormat`'s rule between its fields."""
    schema["if"] = {"properties": {"type": {"const": "json_schema"}}, "required": ["type"]}
    schema["then"] = {"required": ["name", "schema"], "properties": {"name": {"type": "string"},
                                                                      "schema": {"type": "object"}}}
    schema["else"] = {"not": {"anyOf": [{"required": [name]} for name in SCHEMA_FIELDS]}}


class TextFormat(BaseModel):
    """The Responses API's ``text.format``: free text, JSON mode or a JSON schema (its fields flattened here, in
    chat's ``response_format.json_schema``). ``strict`` is accepted either way: answers always validate."""

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True,
                              json_schema_extra=_declare_text_format_rule)

    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, Field(pattern=SCHEMA_NAME)] | None = None
    description: Annotated[str, Field(max_length=MAX_SCHEMA_DESCRIPTION_CHARS)] | None = None
    # "schema" would shadow BaseModel.schema()
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _fields_of_its_type(self) -> TextFormat:
        if self.type == "json_schema":
            for wanted in ("name", "json_schema"):
                if getattr(self, wanted) is None:
                    param = "schema" if wanted == "json_schema" else wanted
                    raise PydanticCustomError("missing_required_parameter",
                                              f"Missing required parameter: 'text.format.{param}'.",
                                              {"param": param, "code": "missing_required_parameter"})
        elif self.model_fields_set - {"type"}:
            raise PydanticCustomError(
                "invalid_value", f"A text format of type '{self.type}' takes no other field.",
                {"param": sorted(self.model_fields_set - {"type"})[0].replace("json_schema", "schema"),
                 "code": "invalid_value"})
        return self

    def echo(self) -> dict[str, Any]:
        """As a response object repeats it."""
        return self.model_dump(by_alias=True, exclude_none=True)


#: ``text`` fields not implemented: SmolLM2 has one verbosity, its own
UNSUPPORTED_TEXT: dict[str, Unsupported] = {"verbosity": Unsupported((None, "medium"))}


class TextConfig(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid",
                              json_schema_extra=lambda schema: declare_unsupported(schema, UNSUPPORTED_TEXT))

    format: TextFormat | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        return refuse_unsupported(data, UNSUPPORTED_TEXT)


def _declare_response_rules(schema: dict[str, Any]) -> None:
    """The unsupported parameters, and the rules between fields: a background response is stored, and a
    conversation keeps its own history (no ``previous_response_id`` beside it)."""
    declare_unsupported(schema, UNSUPPORTED_RESPONSES)
    schema["allOf"] = [
        {"if": {"properties": {"background": {"const": True}}, "required": ["background"]},
         "then": {"properties": {"store": {"const": True}}}},
        {"not": {"required": ["conversation", "previous_response_id"],
                 "properties": {"conversation": {"not": {"type": "null"}},
                                "previous_response_id": {"not": {"type": "null"}}}}},
    ]


class ResponseCreate(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", json_schema_extra=_declare_response_rules)
    model: Annotated[str, Field(max_length=MAX_MODEL_CHARS)]
    input: Annotated[str, Field(min_length=1)] | Annotated[list[InputMessage], Field(min_length=1, max_length=256)]
    instructions: str | None = None
    conversation: Annotated[str, Field(min_length=1, max_length=128)] | ConversationRef | None = None
    previous_response_id: Annotated[str, Field(min_length=1, max_length=128)] | None = None
    stream: bool = False
    store: bool = True
    background: bool = False
    max_output_tokens: Annotated[int, Field(ge=1), INTEGRAL] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    metadata: Metadata | None = None
    user: Annotated[str, Field(max_length=MAX_USER_CHARS)] | None = None
    text: TextConfig | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        return refuse_unsupported(data, UNSUPPORTED_RESPONSES)

    @model_validator(mode="after")
    def _coherent(self) -> ResponseCreate:
        if self.conversation is not None and self.previous_response_id is not None:
            raise PydanticCustomError("invalid_value", "conversation and previous_response_id cannot be used "
                                      "together: a conversation keeps its own history.",
                                      {"param": "previous_response_id", "code": "invalid_value"})
        if self.background and not self.store:
            raise PydanticCustomError("invalid_value", "background responses must be stored (store: true): their "
                                      "result is read later.", {"param": "background", "code": "invalid_value"})
        return self

    @property
    def conversation_id(self) -> str | None:
        if isinstance(self.conversation, ConversationRef):
            return self.conversation.id
        return self.conversation

    @property
    def text_format(self) -> TextFormat | None:
        """A structured output's format; None: plain text."""
        fmt = self.text.format if self.text is not None else None
        return None if fmt is None or fmt.type == "text" else fmt

    @property
    def output_schema(self) -> tuple[dict[str, Any], str, str | None] | None:
        """As chat's: the JSON schema answers must validate against, its parameter's path and its name."""
        fmt = self.text_format
        if fmt is None:
            return None
        if fmt.type == "json_object":
            return {"type": "object"}, "text.format", None
        return fmt.json_schema or {}, "text.format.schema", fmt.name

    def input_messages(self) -> list[ChatMessage]:
        if isinstance(self.input, str):
            return [ChatMessage(role="user", content=self.input)]
        return [m.as_event() for m in self.input]


class ConversationCreate(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    metadata: Metadata | None = None
    items: Annotated[list[InputMessage], Field(max_length=20)] | None = None


class ConversationItemsCreate(BaseModel):
    """``POST /v1/conversations/{id}/items``: up to 20 messages a call, as OpenAI's."""

    model_config = ConfigDict(strict=True, extra="forbid")

    items: Annotated[list[InputMessage], Field(min_length=1, max_length=20)]


class ConversationUpdate(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    metadata: Metadata


# --- the objects answered ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ResponseView:
    """What a response object repeats of its request: built at create, carried in the stream record (a resume on
    another gateway answers the same object)."""

    id: str
    created_at: int
    model: str
    output_item_id: str
    instructions: str | None = None
    previous_response_id: str | None = None
    conversation_id: str | None = None
    background: bool = False
    store: bool = True
    max_output_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    truncation: str = "disabled"
    truncated_items: int = 0
    metadata: dict[str, str] = field(default_factory=dict)
    user: str | None = None
    #: ``text.format`` as the request gave it (None: plain text)
    text_format: dict[str, Any] | None = None
    #: the turn's new input, ``[{"role", "content"}]``: ``input_items`` of a response not stored yet
    input_items: list[dict[str, str]] = field(default_factory=list)

    def to_json(self) -> str:
        return orjson.dumps(asdict(self)).decode()

    @classmethod
    def from_json(cls, text: str) -> ResponseView:
        # A newer gateway's record (a rolling deploy) may carry fields this one does not know: they are left out.
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in orjson.loads(text).items() if k in known})


def usage_of(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + completion_tokens}


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "status": status, "role": "assistant",
            "content": [output_part(text)]}


def output_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def response_object(view: ResponseView, status: str, *, output: list[dict[str, Any]] | None = None,
                    usage: dict[str, Any] | None = None, error: dict[str, Any] | None = None,
                    incomplete_reason: str | None = None, completed_at: int | None = None) -> dict[str, Any]:
    """A ``response`` object in OpenAI's shape; ``truncated_items`` is ours (history items dropped to fit)."""
    return {
        "id": view.id, "object": "response", "created_at": view.created_at, "status": status,
        "background": view.background, "completed_at": completed_at, "error": error,
        "incomplete_details": {"reason": incomplete_reason} if incomplete_reason else None,
        "instructions": view.instructions, "max_output_tokens": view.max_output_tokens, "model": view.model,
        "output": output or [], "parallel_tool_calls": False, "previous_response_id": view.previous_response_id,
        "conversation": {"id": view.conversation_id} if view.conversation_id else None,
        "reasoning": {"effort": None, "summary": None}, "store": view.store, "temperature": view.temperature,
        "text": {"format": view.text_format or {"type": "text"}}, "tool_choice": "none", "tools": [],
        "top_p": view.top_p,
        "truncation": view.truncation, "truncated_items": view.truncated_items, "usage": usage,
        "user": view.user, "metadata": view.metadata,
    }


#: how a stream's end reads as a response: its status, and the incomplete reason
ENDINGS: dict[str, tuple[str, str | None]] = {
    "stop": ("completed", None),
    "length": ("incomplete", "max_output_tokens"),
    "content_filter": ("incomplete", "content_filter"),
    "cancelled": ("cancelled", None),
}


def ending(finish_reason: str | None, error: str | None) -> tuple[str, str | None]:
    """(status, incomplete reason) of a response whose stream ended with ``finish_reason``."""
    if error is not None or finish_reason not in ENDINGS:
        return "failed", None
    return ENDINGS[finish_reason]
