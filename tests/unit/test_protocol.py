"""Request validation and the OpenAI error shape (no server needed)."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

import orjson
import pytest

from bench.loadgen import Target, _body
from bench.workload import Item
from producers.gateway.errors import ApiError
from producers.gateway.protocol import (
    MAX_MODEL_CHARS,
    MAX_NAME_CHARS,
    MAX_REQUEST_EVENT_BYTES,
    MAX_STOP_CHARS,
    MAX_USER_CHARS,
    UNSUPPORTED,
    check_request_size,
    request_size_bound,
)
from producers.gateway.responses_protocol import ResponseCreate
from producers.gateway.routes.chat import parse_body, parse_json
from schemas.codec import codec_for
from schemas.events import ChatMessage, ChatRequest, ReplyTo, SamplingSpec

OK = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def error_of(body: bytes) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse_body(body)
    return info.value


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        (b"{not json", None, "invalid_json"),
        (b"[1, 2]", None, "invalid_json"),
        (b'{"model": "m"}', "messages", "missing_required_parameter"),
        (b'{"model": "m", "messages": []}', "messages", "invalid_value"),
        (b'{"model": "m", "messages": [{"role": "wizard", "content": "x"}]}', "messages[0].role", "invalid_value"),
        (b'{"model": "m", "messages": [{"role": "user", "content": 42}]}', "messages[0].content", "invalid_value"),
        (b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}',
         "messages[0].content[0].type", "unsupported_parameter"),
        (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}', "max_tokens",
         "invalid_value"),
        (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 3}', "temperature",
         "invalid_value"),
        (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 2}', "n", "invalid_value"),
        (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": true}}',
         None, "invalid_value"),
        (b'{"messages": [{"role": "user", "content": "x"}]}', "model", "missing_required_parameter"),
    ],
)
def test_bad_bodies_are_400_with_openai_shape(body: bytes, param: str | None, code: str) -> None:
    err = error_of(body)
    assert err.status == 400
    shape = err.body()["error"]
    assert set(shape) == {"message", "type", "param", "code"}
    assert shape["type"] == "invalid_request_error"
    assert shape["param"] == param
    assert shape["code"] == code
    assert shape["message"]


def test_text_parts_are_accepted_and_joined() -> None:
    body = parse_body(b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},'
                      b' {"type": "text", "text": "b"}]}]}')
    assert body.messages[0].text() == "ab"


def test_documented_extensions_are_accepted() -> None:
    body = parse_body(b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "ignore_eos": true,'
                      b' "min_tokens": 3, "top_k": 5, "repetition_penalty": 1.1, "conversation_id": "c-1"}')
    assert (body.ignore_eos, body.min_tokens, body.top_k, body.repetition_penalty) == (True, 3, 5, 1.1)
    assert body.conversation_id == "c-1"


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    body = parse_body(b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 9,'
                      b' "max_completion_tokens": 4}')
    assert body.requested_max_tokens == 4


def with_fields(**fields: Any) -> bytes:
    return orjson.dumps({**OK, **fields})


#: A value each unsupported parameter would really be sent with (JSON mode, tools...); the rest get a generic one.
REAL_USES: dict[str, Any] = {
    "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
    "tool_choice": "auto",
    "functions": [{"name": "get_weather"}],
    "function_call": "auto",
    "logprobs": True,
    "top_logprobs": 3,
    "modalities": ["text", "audio"],
    "audio": {"voice": "alloy", "format": "wav"},
    "prediction": {"type": "content", "content": "x"},
    "web_search_options": {},
    "verbosity": "low",
    "reasoning_effort": "high",
    "service_tier": "flex",
    "store": True,
    "metadata": {"team": "a"},
    "prompt_cache_key": "user-7",
    "safety_identifier": "user-7",
}


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_unsupported_parameters_are_refused_by_name(name: str) -> None:
    err = error_of(with_fields(**{name: REAL_USES.get(name, {"enabled": True})}))
    assert err.status == 400
    assert err.body()["error"] == {"message": err.message, "type": "invalid_request_error", "param": name,
                                   "code": "unsupported_parameter"}
    assert err.message.startswith(f"Unsupported parameter: '{name}' is not supported")


@pytest.mark.parametrize(("name", "no_op"), [(n, v) for n, rule in sorted(UNSUPPORTED.items()) for v in rule.no_ops])
def test_no_op_values_of_unsupported_parameters_are_accepted(name: str, no_op: Any) -> None:
    body = parse_body(with_fields(**{name: no_op}))
    assert name not in body.model_dump() and not body.model_extra


@pytest.mark.parametrize(("name", "value"), [
    ("logprobs", 0),  # JSON's false is not 0
    ("tools", [{}]),
    ("tool_choice", "required"),
    ("modalities", ["audio"]),
    ("service_tier", "priority"),
])
def test_values_near_a_no_op_are_refused(name: str, value: Any) -> None:
    assert error_of(with_fields(**{name: value})).param == name


@pytest.mark.parametrize("name", ["foo", "min_p", "best_of", "echo", "guided_json", "prompt"])
def test_unknown_fields_get_openais_unrecognized_argument(name: str) -> None:
    err = error_of(with_fields(**{name: 1}))
    assert err.body()["error"] == {"message": f"Unrecognized request argument supplied: {name}",
                                   "type": "invalid_request_error", "param": name, "code": "unknown_parameter"}


def test_every_unknown_field_is_named_before_any_value_is_judged() -> None:
    err = error_of(with_fields(foo=1, bar=2, max_tokens=0))
    assert err.message == "Unrecognized request arguments supplied: foo, bar"
    assert (err.param, err.code) == ("foo", "unknown_parameter")


def test_an_unknown_field_inside_a_text_part_is_named_with_its_path() -> None:
    err = error_of(with_fields(messages=[{"role": "user", "content": [{"type": "text", "text": "a", "cache": 1}]}]))
    assert (err.param, err.code) == ("messages[0].content[0].cache", "unknown_parameter")


@pytest.mark.parametrize(("fields", "param"), [
    ({"max_tokens": "4"}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"max_tokens": 4.5}, "max_tokens"),
    ({"top_k": False}, "top_k"),
    ({"stream": "true"}, "stream"),
    ({"temperature": "0.5"}, "temperature"),
    ({"seed": 2**63}, "seed"),
    ({"seed": 1e19}, "seed"),
    ({"top_k": 2**31}, "top_k"),
    ({"stop": ""}, "stop"),
    ({"stop": ["ok", ""]}, "stop[1]"),
])
def test_values_are_taken_as_their_json_type_and_range(fields: dict[str, Any], param: str) -> None:
    err = error_of(with_fields(**fields))
    assert (err.status, err.param, err.code) == (400, param, "invalid_value")


def test_an_integer_below_64_bits_is_refused_even_when_json_reads_it_as_a_float() -> None:
    # orjson reads an integer beyond 64 bits as a float; rounded, -2**63 - 1 would become -2**63 (in range)
    assert error_of(b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "seed": -9223372036854775809}'
                    ).param == "seed"


def test_integral_numbers_are_integers_as_json_schema_says() -> None:
    body = parse_body(with_fields(max_tokens=4.0, seed=-(2**63), top_k=2**31 - 1))
    assert (body.max_tokens, body.seed, body.top_k) == (4, -(2**63), 2**31 - 1)


def test_our_load_generator_body_is_accepted() -> None:
    body = parse_body(_body(Target(base_url="http://x/v1", model="m"), Item(index=0, prompt="hello", max_tokens=8)))
    assert (body.stream, body.include_usage, body.ignore_eos, body.max_tokens) == (True, True, True, 8)


@pytest.mark.vllm
def test_vllm_bench_serve_body_is_accepted() -> None:
    """The referee's own request function (``vllm bench serve --backend openai-chat``), with the flags
    ``bench/compare.py`` passes and the sampling flags it may add; the body is captured, nothing is sent."""
    from vllm.benchmarks.lib.endpoint_request_func import RequestFuncInput, async_request_openai_chat_completions

    class Refused:
        status, reason = 503, "captured"

        async def __aenter__(self) -> Refused:
            return self

        async def __aexit__(self, *exc: object) -> None:
            return None

    class Capture:
        payloads: list[dict[str, Any]] = []

        def post(self, url: str, json: dict[str, Any], headers: dict[str, str]) -> Refused:
            self.payloads.append(json)
            return Refused()

    session = Capture()
    sampling = {"temperature": 0.0, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1,
                "frequency_penalty": 0.1, "presence_penalty": 0.1}
    for extra_body in (None, sampling):
        request = RequestFuncInput(prompt="hello", api_url="http://x/v1/chat/completions", prompt_len=1,
                                   output_len=16, model="m", ignore_eos=True, extra_body=extra_body)
        asyncio.run(async_request_openai_chat_completions(request, session))  # type: ignore[arg-type]
    for payload in session.payloads:
        body = parse_body(orjson.dumps(payload))
        assert (body.stream, body.include_usage, body.ignore_eos, body.max_completion_tokens) == (True, True, True, 16)
    assert session.payloads[1]["top_k"] == 20


# --- nothing is dropped at any depth (issue 36): a message's, a part's or stream_options' field is acted on or refused

ECHOED_ASSISTANT = {"role": "assistant", "content": "Hello!", "refusal": None, "tool_calls": None,
                    "function_call": None, "audio": None, "annotations": []}


def with_messages(*messages: dict[str, Any], **fields: Any) -> bytes:
    return with_fields(messages=[{"role": "user", "content": "hi"}, *messages], **fields)


def test_an_assistant_message_echoed_by_the_sdk_is_accepted() -> None:
    # what openai-python's ``completion.choices[0].message.model_dump()`` holds: every field a no-op
    body = parse_body(with_messages(ECHOED_ASSISTANT))
    assert body.messages[1].text() == "Hello!" and not body.messages[1].model_extra


@pytest.mark.parametrize(("field", "value", "code"), [
    ("cache_control", {"type": "ephemeral"}, "unknown_parameter"),
    ("tool_calls", [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
     "unsupported_parameter"),
    ("tool_call_id", "c1", "unsupported_parameter"),
    ("refusal", "I cannot", "unsupported_parameter"),
    ("audio", {"id": "a1"}, "unsupported_parameter"),
    ("annotations", [{"type": "url_citation"}], "unsupported_parameter"),
])
def test_a_message_field_not_acted_on_is_refused_naming_its_full_path(field: str, value: Any, code: str) -> None:
    err = error_of(with_messages({**ECHOED_ASSISTANT, field: value}))
    assert (err.status, err.param, err.code) == (400, f"messages[1].{field}", code)
    assert f"messages[1].{field}" in err.message
    if code == "unknown_parameter":
        assert err.message == f"Unrecognized request argument supplied: messages[1].{field}"


@pytest.mark.parametrize("part_type", ["image_url", "input_audio", "file", "refusal"])
def test_a_content_part_other_than_text_is_refused_naming_its_type(part_type: str) -> None:
    err = error_of(with_messages({"role": "user", "content": [{"type": part_type, part_type: {}}]}))
    assert (err.param, err.code) == ("messages[1].content[0].type", "unsupported_parameter")
    assert f"'{part_type}'" in err.message


@pytest.mark.parametrize(("options", "param", "code"), [
    ({"include_usage": True, "chunk_size": 8}, "stream_options.chunk_size", "unknown_parameter"),
    ({"include_obfuscation": True}, "stream_options.include_obfuscation", "unsupported_parameter"),
])
def test_a_stream_option_not_acted_on_is_refused(options: dict[str, Any], param: str, code: str) -> None:
    err = error_of(with_fields(stream=True, stream_options=options))
    assert (err.param, err.code) == (param, code)


def test_stream_options_that_ask_for_nothing_more_are_accepted() -> None:
    body = parse_body(with_fields(stream=True, stream_options={"include_usage": True, "include_obfuscation": False}))
    assert body.include_usage


# --- bounds of free text that is kept but never counted as tokens (issue 37 H2)

@pytest.mark.parametrize(("fields", "param"), [
    ({"user": "u" * (MAX_USER_CHARS + 1)}, "user"),
    ({"messages": [{"role": "user", "content": "x", "name": "n" * (MAX_NAME_CHARS + 1)}]}, "messages[0].name"),
    ({"stop": ["s" * (MAX_STOP_CHARS + 1)]}, "stop[0]"),
    ({"stop": "s" * (MAX_STOP_CHARS + 1)}, "stop"),
    ({"model": "m" * (MAX_MODEL_CHARS + 1)}, "model"),
    ({"metadata": {"k": "v" * 513}}, "metadata.k"),
    ({"metadata": {"k" * 65: "v"}}, "metadata." + "k" * 65),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
])
def test_free_text_beyond_its_bound_is_refused_naming_the_field(fields: dict[str, Any], param: str) -> None:
    err = error_of(with_fields(**fields))
    assert (err.status, err.param, err.code) == (400, param, "invalid_value")
    assert err.body()["error"]["type"] == "invalid_request_error"


def test_free_text_at_its_bound_is_accepted() -> None:
    body = parse_body(with_fields(user="u" * MAX_USER_CHARS, stop=["s" * MAX_STOP_CHARS],
                                  messages=[{"role": "user", "content": "x", "name": "n" * MAX_NAME_CHARS}]))
    assert body.user is not None and len(body.user) == MAX_USER_CHARS


def request_of(text: str, *, tokens: int = 10, extra: str = "") -> tuple[ChatRequest, str]:
    request = ChatRequest(
        request_id="chatcmpl-1", created_at=datetime.now(UTC), org_id="org", key_id="key", tier="free", model="m",
        messages=[ChatMessage(role="user", content=text)], prompt_token_ids=list(range(tokens)),
        sampling=SamplingSpec(max_tokens=4), stream=False, reply=ReplyTo(partition=0, gateway_id="g"))
    return request, extra


def test_the_size_bound_of_a_request_is_never_below_its_encoding() -> None:
    for text, tokens in (("", 0), ("hi", 3), ("é" * 1000, 2000), ("x" * 100_000, 8192)):
        request, _ = request_of(text, tokens=tokens)
        assert request_size_bound(request) >= len(codec_for(ChatRequest).encode(request))


def test_a_request_within_the_limit_is_accepted() -> None:
    check_request_size(*request_of("x" * 100_000, tokens=8192))


HALF = MAX_REQUEST_EVENT_BYTES // 2


@pytest.mark.parametrize(("text", "extra"), [("x" * MAX_REQUEST_EVENT_BYTES, ""), ("x" * HALF, "y" * HALF)])
def test_a_request_that_would_write_more_than_the_limit_is_refused_before_it_is_produced(text: str,
                                                                                        extra: str) -> None:
    with pytest.raises(ApiError) as refused:
        check_request_size(*request_of(text, extra=extra))
    error = refused.value.body()["error"]
    assert (refused.value.status, error["param"], error["code"]) == (400, "messages", "request_too_large")
    assert str(MAX_REQUEST_EVENT_BYTES) in error["message"]


# --- the Responses API and conversations: the same rules

def response_error(**fields: Any) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse_json(orjson.dumps({"model": "m", "input": "hi", **fields}), ResponseCreate)
    return info.value


OUTPUT_ITEM = {"id": "msg_1", "type": "message", "status": "completed", "role": "assistant",
               "content": [{"type": "output_text", "text": "Hello!", "annotations": [], "logprobs": []}]}


def test_an_output_item_echoed_as_input_is_accepted() -> None:
    body = parse_json(orjson.dumps({"model": "m", "input": [{"role": "user", "content": "hi"}, OUTPUT_ITEM]}),
                      ResponseCreate)
    assert [m.content for m in body.input_messages()] == ["hi", "Hello!"]


@pytest.mark.parametrize(("fields", "param", "code"), [
    ({"user": "u" * (MAX_USER_CHARS + 1)}, "user", "invalid_value"),
    ({"model": "m" * (MAX_MODEL_CHARS + 1)}, "model", "invalid_value"),
    ({"input": [{**OUTPUT_ITEM, "id": "i" * 129}]}, "input[0].id", "invalid_value"),
    ({"input": [{**OUTPUT_ITEM, "status": "whatever"}]}, "input[0].status", "invalid_value"),
    ({"input": [{**OUTPUT_ITEM, "cache_control": {}}]}, "input[0].cache_control", "unknown_parameter"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "a", "cache_control": {}}]}]},
     "input[0].content[0].cache_control", "unknown_parameter"),
    ({"input": [{"role": "user", "content": [{"type": "output_text", "text": "a", "annotations": [{"x": 1}]}]}]},
     "input[0].content[0].annotations", "unsupported_parameter"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type", "unsupported_parameter"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input[0].type",
     "unsupported_parameter"),
    ({"stream_options": {"include_obfuscation": True}}, "stream_options", "unsupported_parameter"),
])
def test_a_response_field_not_acted_on_or_beyond_its_bound_is_refused(fields: dict[str, Any], param: str,
                                                                      code: str) -> None:
    err = response_error(**fields)
    assert (err.status, err.param, err.code) == (400, param, code)
