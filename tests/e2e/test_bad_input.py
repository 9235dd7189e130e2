"""Bad input gets a clear 4xx in OpenAI's error shape, and nothing reaches Kafka."""

from __future__ import annotations

import asyncio

import httpx
import orjson
import pytest

from runtime.settings import Settings
from schemas.topics import TOPICS
from tests.conftest import Caller
from tests.e2e.conftest import MODEL
from tests.helpers import end_offsets

pytestmark = pytest.mark.e2e


def body(**fields: object) -> bytes:
    return orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields})


LONG_PROMPT = "word " * 2100  # ~2100 tokens: more than the 2048-token context

CASES = [
    # (name, raw body, status, param, code)
    ("malformed json", b'{"model": "x", "messages": [', 400, None, "invalid_json"),
    ("not an object", b'"hello"', 400, None, "invalid_json"),
    ("missing messages", orjson.dumps({"model": MODEL}), 400, "messages", "missing_required_parameter"),
    ("empty messages", body(messages=[]), 400, "messages", "invalid_value"),
    ("unknown role", body(messages=[{"role": "robot", "content": "x"}]), 400, "messages[0].role", "invalid_value"),
    ("non-string content", body(messages=[{"role": "user", "content": {"a": 1}}]), 400, "messages[0].content",
     "invalid_value"),
    ("max_tokens zero", body(max_tokens=0), 400, "max_tokens", "invalid_value"),
    ("max_tokens negative", body(max_tokens=-5), 400, "max_tokens", "invalid_value"),
    ("max_tokens beyond the context", body(max_tokens=5000), 400, "max_tokens", "context_length_exceeded"),
    ("prompt longer than the context", body(messages=[{"role": "user", "content": LONG_PROMPT}]), 400, "messages",
     "context_length_exceeded"),
    ("unknown model", body(model="gpt-17"), 404, "model", "model_not_found"),
    ("n > 1", body(n=3), 400, "n", "invalid_value"),
    ("temperature out of range", body(temperature=-1), 400, "temperature", "invalid_value"),
    ("oversize body", body(messages=[{"role": "user", "content": "x" * 2_000_000}]), 413, None, "request_too_large"),
    # an OpenAI parameter we do not implement is refused, never ignored (JSON mode would come back as free text)
    # a structured output the engine could not decode under, or a token the model lacks: refused before Kafka
    ("schema the engine cannot decode", body(response_format={"type": "json_schema", "json_schema": {
        "name": "tags", "schema": {"type": "array", "uniqueItems": True}}}), 400, "response_format.json_schema.schema",
     "invalid_json_schema"),
    ("json_schema without its schema", body(response_format={"type": "json_schema"}), 400,
     "response_format.json_schema", "invalid_value"),
    ("logit_bias of a token the model lacks", body(logit_bias={"999999": 5}), 400, "logit_bias", "invalid_value"),
    ("logit_bias out of range", body(logit_bias={"1": 500}), 400, "logit_bias.1", "invalid_value"),
    ("tools", body(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tools", "unsupported_parameter"),
    ("logprobs", body(logprobs=True), 400, "logprobs", "unsupported_parameter"),
    ("unrecognized argument", body(frobnicate=True), 400, "frobnicate", "unknown_parameter"),
    # the engine refuses an empty stop string: before this was checked, after the request was accepted (a 502)
    ("empty stop string", body(stop=[""]), 400, "stop[0]", "invalid_value"),
    # nothing is dropped silently at any depth: a field of a message, a part or stream_options is acted on or refused
    ("unknown message field", body(messages=[{"role": "user", "content": "x"},
                                             {"role": "assistant", "content": "y", "cache_control": {"type": "x"}}]),
     400, "messages[1].cache_control", "unknown_parameter"),
    ("tool calls on an assistant message", body(messages=[
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "y", "tool_calls": [{"id": "c", "type": "function",
                                                              "function": {"name": "f", "arguments": "{}"}}]}]),
     400, "messages[1].tool_calls", "unsupported_parameter"),
    ("image part", body(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     400, "messages[0].content[0].type", "unsupported_parameter"),
    ("unknown stream_options field", body(stream=True, stream_options={"include_usage": True, "chunk_size": 4}),
     400, "stream_options.chunk_size", "unknown_parameter"),
    # free text that is kept but never counted as tokens is bounded (issue 37 H2)
    ("user too long", body(user="u" * 257), 400, "user", "invalid_value"),
    ("name too long", body(messages=[{"role": "user", "content": "x", "name": "n" * 65}]), 400, "messages[0].name",
     "invalid_value"),
    ("stop string too long", body(stop=["s" * 257]), 400, "stop[0]", "invalid_value"),
]


@pytest.fixture()
def http(base_url: str, caller: Caller) -> httpx.Client:
    return httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {caller.secret}"}, timeout=30)


def assert_openai_error(response: httpx.Response, status: int, param: str | None, code: str | None) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["param"] == param and error["code"] == code


async def test_bad_requests_are_rejected_before_kafka(http: httpx.Client, stack: Settings) -> None:
    topics = [stack.kafka.topic(t.name) for t in (TOPICS.requests_submitted, *TOPICS.work_queues())]
    before = [await end_offsets(stack.kafka, topic) for topic in topics]
    for name, raw, status, param, code in CASES:
        response = await asyncio.to_thread(http.post, "/chat/completions", content=raw,
                                           headers={"content-type": "application/json"})
        try:
            assert_openai_error(response, status, param, code)
        except AssertionError as exc:
            raise AssertionError(f"case {name!r}: {exc}") from exc
    after = [await end_offsets(stack.kafka, topic) for topic in topics]
    assert after == before, "a rejected request reached a request topic"


def test_missing_and_wrong_keys_are_401(base_url: str) -> None:
    missing = httpx.post(f"{base_url}/chat/completions", content=body())
    assert_openai_error(missing, 401, None, None)
    assert "API key" in missing.json()["error"]["message"]
    wrong = httpx.post(f"{base_url}/chat/completions", content=body(), headers={"Authorization": "Bearer sk-kns-nope"})
    assert_openai_error(wrong, 401, None, "invalid_api_key")
    assert httpx.get(f"{base_url}/models").status_code == 401


def test_unknown_routes_and_methods_keep_the_shape(http: httpx.Client) -> None:
    assert_openai_error(http.get("/nothing-here"), 404, None, "not_found")
    assert_openai_error(http.put("/chat/completions"), 405, None, "method_not_allowed")
    assert_openai_error(http.get("/models/gpt-17"), 404, "model", "model_not_found")


def test_no_op_values_of_unsupported_parameters_are_answered(http: httpx.Client) -> None:
    response = http.post("/chat/completions", content=body(max_tokens=2, tools=[], tool_choice="none", logprobs=False,
                                                            response_format={"type": "text"}, logit_bias={}))
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] is not None
