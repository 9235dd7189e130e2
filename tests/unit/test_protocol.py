"""Request validation and the OpenAI error shape (no server needed)."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from bench.loadgen import Target, _body
from bench.workload import Item
from producers.gateway.errors import ApiError
from producers.gateway.protocol import UNSUPPORTED
from producers.gateway.routes.chat import parse_body

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
        (b'{"model": "m", "messages": [{"role": "wizard", "content": "x"}]}', "messages.0.role", "invalid_value"),
        (b'{"model": "m", "messages": [{"role": "user", "content": 42}]}', "messages.0.content", "invalid_value"),
        (b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}',
         "messages.0.content.0.type", "invalid_value"),
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
    "response_format": {"type": "json_object"},
    "logprobs": True,
    "top_logprobs": 3,
    "logit_bias": {"50256": -100},
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
    ("response_format", {"type": "text", "json_schema": {}}),
    ("tools", [{}]),
    ("tool_choice", "required"),
    ("modalities", ["audio"]),
    ("service_tier", "priority"),
])
def test_values_near_a_no_op_are_refused(name: str, value: Any) -> None:
    assert error_of(with_fields(**{name: value})).param == name


def test_the_issues_json_mode_client_gets_an_error_not_free_text() -> None:
    err = error_of(with_fields(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}))
    assert (err.status, err.param, err.code) == (400, "response_format", "unsupported_parameter")


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
    assert (err.param, err.code) == ("messages.0.content.0.cache", "unknown_parameter")


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
    ({"stop": ["ok", ""]}, "stop.1"),
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
