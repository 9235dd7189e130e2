"""``/openapi.json`` tells the truth about ``POST /v1/chat/completions``: the body clients must send (the same rules
``parse_body`` applies) and every status the route answers, in OpenAI's error shape (no server needed)."""

from __future__ import annotations

from typing import Any

import jsonschema_rs
import orjson
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from producers.gateway import errors
from producers.gateway.app import create_app
from producers.gateway.errors import ApiError
from producers.gateway.protocol import UNSUPPORTED, chat_request_schema
from producers.gateway.routes.chat import parse_body
from runtime.settings import load_settings

OK: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def operation() -> dict[str, Any]:
    document = create_app(load_settings()).openapi()
    chat: dict[str, Any] = document["paths"]["/v1/chat/completions"]["post"]
    assert document["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    return chat


def test_the_request_body_is_declared(operation: dict[str, Any]) -> None:
    body = operation["requestBody"]
    assert body["required"] is True
    schema = body["content"]["application/json"]["schema"]
    # FastAPI's OpenAPI model rewrites it a little (bounds as floats, no null defaults): compare what matters
    assert set(schema["properties"]) == set(chat_request_schema()["properties"])
    assert schema["additionalProperties"] is False and schema["required"] == ["model", "messages"]
    for name, rule in UNSUPPORTED.items():
        assert schema["properties"][name]["enum"] == list(rule.no_ops)
    # self-contained, and no pydantic keyword JSON Schema does not know (``ge`` instead of ``minimum``)
    text = orjson.dumps(schema).decode()
    assert "$ref" not in text and '"ge"' not in text and '"le"' not in text


def test_every_status_is_declared_with_the_openai_error_body(operation: dict[str, Any]) -> None:
    responses = operation["responses"]
    assert set(responses) == {"200", "400", "401", "403", "404", "413", "429", "500", "502", "503", "504"}
    assert "x-ratelimit-remaining-tokens" in responses["200"]["headers"]
    assert {"retry-after", "x-ratelimit-reset-requests"} <= set(responses["429"]["headers"])
    assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
    for status in set(responses) - {"200"}:
        assert responses[status]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/ErrorResponse"}
    assert operation["security"] == [{"HTTPBearer": []}]


def accepted(raw: bytes) -> bool:
    try:
        parse_body(raw)
    except ApiError:
        return False
    return True


BODIES: list[dict[str, Any]] = [
    OK,
    {**OK, "tools": [], "logprobs": False, "response_format": {"type": "text"}, "tool_choice": "none"},
    {**OK, "tools": [{"type": "function"}]},
    {**OK, "response_format": {"type": "json_object"}},
    {**OK, "logprobs": 0},
    {**OK, "logit_bias": {"1": 5}},
    {**OK, "unknown_thing": 1},
    {**OK, "stream": True, "stream_options": {"include_usage": True}},
    {**OK, "stream_options": {"include_usage": True}},
    {**OK, "stream_options": None},
    {**OK, "max_tokens": 0},
    {**OK, "max_tokens": 4.0},
    {**OK, "max_tokens": "4"},
    {**OK, "seed": 2**63 - 1},  # its bounds are a format (int64), which schemathesis enforces and plain JSON Schema not
    {**OK, "top_k": -1},
    {**OK, "top_k": -2},
    {**OK, "stop": ""},
    {**OK, "n": 2},
    {**OK, "messages": [{"role": "tool", "content": "x"}]},
    {**OK, "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}], "name": "n"}]},
]


@pytest.mark.parametrize("body", BODIES)
def test_the_schema_accepts_exactly_what_the_gateway_accepts(body: dict[str, Any]) -> None:
    validator = jsonschema_rs.validator_for(chat_request_schema())
    assert validator.is_valid(body) == accepted(orjson.dumps(body))


def test_a_405_says_which_methods_are_allowed() -> None:
    app = FastAPI()
    errors.install(app)

    @app.post("/only-post")
    async def only_post() -> None:
        return None

    response = TestClient(app).get("/only-post")
    assert response.status_code == 405
    assert response.headers["allow"] == "POST"
    assert response.json()["error"]["code"] == "method_not_allowed"
