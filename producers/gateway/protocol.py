"""OpenAI wire models for ``/v1/chat/completions`` (with vLLM's sampling extensions) and ``/v1/models``.

Requests are validated here (types, ranges and sizes); rules that need the tokenizer or the model card (context
length) live in ``prompt.py``. Nothing a client sends is silently ignored, at any depth: an OpenAI parameter we do
not implement is refused with a 400 naming its path unless its value asks for nothing (:data:`UNSUPPORTED` for the
request, :data:`UNSUPPORTED_MESSAGE` for a message, :data:`UNSUPPORTED_STREAM_OPTIONS`), and a field no OpenAI API
knows gets OpenAI's "Unrecognized request argument supplied" (``messages[1].cache_control``). The OpenAPI schema of
the request (:func:`chat_request_schema`) is built from the same models and tables, so the document says what is
accepted.

Sizes: every free-text field that is not rendered into the prompt (so neither counted nor billed as tokens) has a
bound (:data:`MAX_USER_CHARS`, :data:`MAX_NAME_CHARS`, :data:`MAX_STOP_CHARS`, the metadata bounds); what is rendered
is counted as prompt tokens and bounded by the context. What one request makes the gateway write (its Kafka event,
kept 7 days and copied by the pre-filter, then its stream record and stored completion) is bounded as a whole by
:func:`check_request_size`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import orjson
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from producers.gateway.errors import ApiError, bad_request
from schemas.codec import codec_for
from schemas.events import ChatRequest

ALLOWED_ROLES = ("system", "developer", "user", "assistant")


@dataclass(frozen=True)
class Unsupported:
    """An OpenAI parameter we do not implement. ``no_ops`` are the values that ask for exactly what we do anyway
    (its absence, an empty list, OpenAI's default...): those are accepted and dropped, any other is a 400."""

    no_ops: tuple[Any, ...] = (None,)
    hint: str = ""

    def accepts(self, value: Any) -> bool:
        return any(_same_json(value, no_op) for no_op in self.no_ops)

    def message(self, name: str) -> str:
        accepted = " or ".join(orjson.dumps(v).decode() for v in self.no_ops)
        hint = f" {self.hint}" if self.hint else ""
        return f"Unsupported parameter: '{name}' is not supported by this server; only {accepted} is accepted.{hint}"


#: Every OpenAI chat-completions parameter this server does not implement (OpenAI's API reference, as of
#: openai-python 3.54's ``CompletionCreateParams``), with the values that are no-ops. The request model, its error
#: and the OpenAPI schema all read this table: a parameter starts working by leaving it for a real field.
UNSUPPORTED: dict[str, Unsupported] = {
    # tool and function calling: an empty tool list, or "none", asks for plain text
    "tools": Unsupported((None, [])),
    "tool_choice": Unsupported((None, "none")),
    "functions": Unsupported((None, [])),
    "function_call": Unsupported((None, "none")),
    # meaningless without tools, and the only tool list accepted is empty
    "parallel_tool_calls": Unsupported((None, True, False)),
    # output shape: log-probabilities would come back as plain text
    "logprobs": Unsupported((None, False)),
    "top_logprobs": Unsupported((None, 0)),
    "modalities": Unsupported((None, ["text"])),
    "audio": Unsupported(),
    "prediction": Unsupported(),
    "web_search_options": Unsupported(),
    "verbosity": Unsupported(),
    # SmolLM2 does not reason: "none" is what it does
    "reasoning_effort": Unsupported((None, "none")),
    # OpenAI platform features: one service tier, no moderation settings
    "service_tier": Unsupported((None, "auto", "default")),
    "moderation": Unsupported(),
    "prompt_cache_key": Unsupported(hint="Turns of a stored conversation (conversation_id, from POST "
                                         "/v1/conversations) share one worker's prefix cache."),
    "prompt_cache_retention": Unsupported(),
    "prompt_cache_options": Unsupported(),
    "safety_identifier": Unsupported(hint="Use user to identify the end user."),
}

#: Bounds of free text that is not rendered into the prompt (stored and sent along, never counted as tokens): the
#: end user's id (OpenAI's ``user``, 256 as OpenAI's ``safety_identifier``), a participant's name (64, OpenAI's bound
#: on names), the model's name, each stop string (a stop longer than this never ends a real answer)
MAX_USER_CHARS = 256
MAX_NAME_CHARS = 64
MAX_MODEL_CHARS = 256
MAX_STOP_CHARS = 256
#: What one request may make the gateway write: its serialized Kafka event (messages, token ids, sampling, user,
#: metadata) plus its stream record's payload. Kafka refuses records over 1 MiB (``message.max.bytes``); a stored
#: completion adds the answer's text to the request's messages, up to the context's tokens at a few bytes each.
MAX_REQUEST_EVENT_BYTES = 768 * 1024

# Every request model is strict: a JSON value of another type is an error ("4" or true is not an integer), as
# OpenAI answers, instead of pydantic's coercion.


def unsupported_value(kind: str, value: object, param: str, supported: str) -> PydanticCustomError:
    """A 400 for a ``type`` (of a content part, of an input item) this server does not serve, naming it."""
    return PydanticCustomError("unsupported_parameter",
                               f"{kind} of type '{str(value)[:64]}' are not supported by this server; only "
                               f"{supported}.", {"param": param, "code": "unsupported_parameter"})


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["text"]
    text: str

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("type"), str) and data["type"] != "text":
            raise unsupported_value("Content parts", data["type"], "type", "text parts are")
        return data


#: OpenAI message fields this server does not act on, with their no-op values: what an SDK echoes back of an
#: assistant message (``message.model_dump()``) is accepted, a tool call or an audio reference is not.
UNSUPPORTED_MESSAGE: dict[str, Unsupported] = {
    "tool_calls": Unsupported((None, [])),
    "tool_call_id": Unsupported(),
    "function_call": Unsupported(),
    "refusal": Unsupported(),
    "audio": Unsupported(),
    "annotations": Unsupported((None, [])),
}


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid",
                              json_schema_extra=lambda schema: declare_unsupported(schema, UNSUPPORTED_MESSAGE))

    role: Annotated[str, WithJsonSchema({"type": "string", "enum": list(ALLOWED_ROLES)})]
    content: str | list[TextPart]
    #: kept with the request and its stored completion; SmolLM2's chat template does not render it
    name: Annotated[str, Field(max_length=MAX_NAME_CHARS)] | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        return refuse_unsupported(data, UNSUPPORTED_MESSAGE)

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


#: ``stream_options`` fields not implemented: the stream carries no obfuscation padding
UNSUPPORTED_STREAM_OPTIONS: dict[str, Unsupported] = {"include_obfuscation": Unsupported((None, False))}


class StreamOptions(BaseModel):
    model_config = ConfigDict(
        strict=True, extra="forbid",
        json_schema_extra=lambda schema: declare_unsupported(schema, UNSUPPORTED_STREAM_OPTIONS))

    include_usage: bool = False

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        return refuse_unsupported(data, UNSUPPORTED_STREAM_OPTIONS)


#: a structured output's name, as OpenAI bounds it
SCHEMA_NAME = r"^[a-zA-Z0-9_-]{1,64}$"
MAX_SCHEMA_DESCRIPTION_CHARS = 1024


class JsonSchemaSpec(BaseModel):
    """A structured output's schema, as chat's ``response_format.json_schema`` and the Responses API's
    ``text.format`` (flattened there) name it. ``strict`` is accepted either way: every answer validates against the
    schema whatever it says (the engine decodes under the schema's grammar)."""

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)

    name: Annotated[str, Field(pattern=SCHEMA_NAME)]
    description: Annotated[str, Field(max_length=MAX_SCHEMA_DESCRIPTION_CHARS)] | None = None
    # "schema" would shadow BaseModel.schema()
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


def _declare_format_rule(schema: dict[str, Any]) -> None:
    """What JSON Schema can say of :class:`ResponseFormat`'s rule between its fields."""
    schema["if"] = {"properties": {"type": {"const": "json_schema"}}, "required": ["type"]}
    schema["then"] = {"required": ["json_schema"], "properties": {"json_schema": {"type": "object"}}}
    schema["else"] = {"properties": {"json_schema": {"type": "null"}}}


class ResponseFormat(BaseModel):
    """Chat's ``response_format``: free text, JSON mode (any JSON object) or a JSON schema."""

    model_config = ConfigDict(strict=True, extra="forbid", json_schema_extra=_declare_format_rule)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise PydanticCustomError(
                "invalid_value", "A json_schema object is required with type json_schema, and allowed with no other.",
                {"param": "json_schema", "code": "invalid_value"})
        return self


#: OpenAI's bound on logit_bias: token ids as decimal strings, each biased by -100 to 100
MAX_LOGIT_BIAS_TOKENS = 300
TOKEN_ID_PATTERN = r"^(0|[1-9][0-9]{0,9})$"
TokenIdKey = Annotated[str, Field(pattern=TOKEN_ID_PATTERN)]
Bias = Annotated[float, Field(ge=-100.0, le=100.0)]
#: pydantic's own schema of the dict leaves its keys' pattern out
LOGIT_BIAS_SCHEMA = {"type": "object", "propertyNames": {"pattern": TOKEN_ID_PATTERN},
                     "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
                     "maxProperties": MAX_LOGIT_BIAS_TOKENS}


#: Bounds of the event schema's Avro int and long (``schemas/avro/chat_request``).
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def _integral(value: Any) -> Any:
    """JSON Schema's integer includes ``4.0`` (a number without a fraction), which strict pydantic refuses. Beyond
    2**53 a float is no longer exact: orjson reads an integer outside 64 bits as one, and rounding it could bring
    it back in range, so such floats stay floats (and are refused)."""
    if isinstance(value, float) and value.is_integer() and abs(value) <= 2**53:
        return int(value)
    return value


#: After the constraints in ``Annotated[int, Field(...), INTEGRAL]``: placed before them, pydantic would write
#: ``ge`` instead of ``minimum`` into the JSON schema.
INTEGRAL = BeforeValidator(_integral)
#: Declared by its format: FastAPI's OpenAPI model turns bounds into floats, and 2**63 - 1 would read 2**63.
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX), INTEGRAL,
                  WithJsonSchema({"type": "integer", "format": "int64"})]
#: An empty stop string would stop nothing; the engine refuses it (after the request was accepted).
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]


def refuse_unsupported(data: Any, table: dict[str, Unsupported]) -> Any:
    """A request body (or a message, a part: ``errors.from_validation`` prefixes the name with their path) without
    the unsupported parameters that ask for nothing; a 400 naming any other."""
    if not isinstance(data, dict):
        return data
    for name, rule in table.items():
        if name in data and not rule.accepts(data[name]):
            raise PydanticCustomError("unsupported_parameter", rule.message(name),
                                      {"param": name, "code": "unsupported_parameter"})
    return {k: v for k, v in data.items() if k not in table}


def _same_json(a: Any, b: Any) -> bool:
    """JSON equality: ``false`` is not ``0`` (Python's ``False == 0`` is), ``1`` is ``1.0``."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same_json(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_json(a[k], b[k]) for k in a)
    return type(a) is type(b) and bool(a == b)


def declare_unsupported(schema: dict[str, Any], table: dict[str, Unsupported]) -> None:
    """A model's JSON schema: each unsupported parameter of ``table`` with its accepted values only."""
    properties = schema.setdefault("properties", {})
    for name, rule in table.items():
        properties[name] = {"enum": list(rule.no_ops), "description": rule.message(name)}


def _declare_chat_rules(schema: dict[str, Any]) -> None:
    """JSON schema of the request: the unsupported parameters, and the one rule between fields that JSON Schema can
    say (stream_options only with stream: true)."""
    declare_unsupported(schema, UNSUPPORTED)
    schema["dependentSchemas"] = {"stream_options": {"anyOf": [
        {"properties": {"stream": {"const": True}}, "required": ["stream"]},
        {"properties": {"stream_options": {"type": "null"}}},
    ]}}


#: OpenAI's bounds on metadata: up to 16 pairs, keys up to 64 characters, values up to 512
MetadataKey = Annotated[str, Field(min_length=1, max_length=64)]
MetadataValue = Annotated[str, Field(max_length=512)]


class ChatCompletionRequest(BaseModel):
    # A field that is neither ours nor in UNSUPPORTED is an error (errors.from_validation words it as OpenAI).
    model_config = ConfigDict(strict=True, extra="forbid", json_schema_extra=_declare_chat_rules)

    model: Annotated[str, Field(max_length=MAX_MODEL_CHARS)]
    messages: Annotated[list[ChatMessageIn], Field(min_length=1)]
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, Field(ge=1), INTEGRAL] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1), INTEGRAL] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    n: Annotated[int, Field(ge=1, le=1), INTEGRAL] = 1
    seed: Int64 | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=4)] | None = None
    user: Annotated[str, Field(max_length=MAX_USER_CHARS)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    # vLLM's sampling extensions, so that `vllm bench serve` runs unchanged
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0), INTEGRAL] = 0
    # -1 or 0 disable it; the bound is the event schema's (an Avro int)
    top_k: Annotated[int, Field(ge=-1, le=INT32_MAX), INTEGRAL] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = None
    # ours: turns of one conversation share a partition (and a worker's prefix cache)
    conversation_id: Annotated[str, Field(min_length=1, max_length=128)] | None = None
    # stored completions (GET /v1/chat/completions/{id}, its messages, list, delete), as OpenAI's
    store: bool | None = None
    metadata: Annotated[dict[MetadataKey, MetadataValue], Field(max_length=16)] | None = None
    # structured outputs (JSON mode, a JSON schema) and token biases, decoded by the engine
    response_format: ResponseFormat | None = None
    logit_bias: Annotated[dict[TokenIdKey, Bias], Field(max_length=MAX_LOGIT_BIAS_TOKENS),
                          WithJsonSchema(LOGIT_BIAS_SCHEMA)] | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        return refuse_unsupported(data, UNSUPPORTED)

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

    @property
    def output_schema(self) -> tuple[dict[str, Any], str, str | None] | None:
        """The JSON schema answers must validate against, its parameter's path and its name; None: free text."""
        fmt = self.response_format
        if fmt is None or fmt.type == "text":
            return None
        if fmt.json_schema is None:  # json_object
            return {"type": "object"}, "response_format", None
        # a json_schema without a schema asks for any JSON value, as OpenAI reads it
        return fmt.json_schema.json_schema or {}, "response_format.json_schema.schema", fmt.json_schema.name


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str
    refusal: None


class Choice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: None
    finish_reason: str


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class ChatCompletion(BaseModel):
    """The non-streaming answer as ``producers.relay.sse.completion`` writes it, for ``/openapi.json``."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    system_fingerprint: str | None


class ChunkDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(BaseModel):
    index: int
    delta: ChunkDelta
    logprobs: None
    finish_reason: str | None


class ChatCompletionChunk(BaseModel):
    """One streamed event as ``producers.relay.sse.ChunkFormatter`` writes it, for ``/openapi.json``; ``usage``
    only with ``stream_options.include_usage`` (null on token chunks, set on the last one, whose choices are
    empty)."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


def chat_request_schema() -> dict[str, Any]:
    return openapi_schema(ChatCompletionRequest)


def openapi_schema(model: type[BaseModel]) -> dict[str, Any]:
    """A model's JSON schema for a route's ``openapi_extra``, self-contained: an operation cannot add
    ``components``, and pydantic's ``#/$defs/...`` references would point at the document's root."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            if "$ref" in node:
                target = copy.deepcopy(defs[node["$ref"].rsplit("/", 1)[-1]])
                return inline({**target, **{k: v for k, v in node.items() if k != "$ref"}})
            return {k: inline(v) for k, v in node.items()}
        if isinstance(node, list):
            return [inline(v) for v in node]
        return node

    result: dict[str, Any] = inline(schema)
    return result


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    usage: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return usage


def request_size_bound(request: ChatRequest, extra: str = "") -> int:
    """An upper bound, in bytes, of what ``request`` makes the gateway write: its Avro event (every text field's
    UTF-8 bytes, a varint of at most 5 bytes per token id, 32 bytes of framing per message and stop string, 2 KiB for
    the fields of fixed size) plus the stream record's payload ``extra``. Cheap (no encoding): ~2 µs a request."""
    texts = [request.user or "", request.client_addr or "", request.conversation_id or "", *request.sampling.stop,
             *request.metadata, *request.metadata.values(), request.sampling.json_schema or "", extra]
    if request.turn is not None:
        texts += [request.turn.instructions or "", request.turn.previous_response_id or "",
                  request.turn.text_format or ""]
    messages = sum(len(m.content.encode()) + len(m.role) + len((m.name or "").encode()) + 32 for m in request.messages)
    return (messages + sum(len(t.encode()) for t in texts) + 32 * len(request.sampling.stop)
            + 5 * len(request.prompt_token_ids) + 24 * len(request.sampling.logit_bias) + 2048)


def check_request_size(request: ChatRequest, extra: str = "") -> None:
    """A 400 for a request whose event and stream record would exceed :data:`MAX_REQUEST_EVENT_BYTES`, before it is
    admitted or produced. Encoded exactly only when the cheap bound exceeds the limit (a few such requests are
    worth 45 µs; every request is not)."""
    if request_size_bound(request, extra) <= MAX_REQUEST_EVENT_BYTES:
        return
    size = len(codec_for(ChatRequest).encode(request)) + len(extra.encode())
    if size > MAX_REQUEST_EVENT_BYTES:
        raise request_too_large(size)


def request_too_large(size: int) -> ApiError:
    return bad_request(f"The request is too large to accept: with its history and instructions it makes a record of "
                       f"{size} bytes, and at most {MAX_REQUEST_EVENT_BYTES} are kept per request. Shorten the "
                       "messages (or the conversation's history).", param="messages", code="request_too_large")
