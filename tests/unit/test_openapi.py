"""``/openapi.json`` tells the truth: the bodies clients must send (the same rules the parsers apply, at every depth),
every status each operation answers, in OpenAI's error shape, and the links from each create to what reads, cancels
and deletes what it created (no server needed; schemathesis checks the running gateway in
``tests/e2e/test_openapi_contract.py``)."""

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
from producers.gateway.protocol import UNSUPPORTED, chat_request_schema, openapi_schema
from producers.gateway.responses_protocol import ResponseCreate
from producers.gateway.routes.chat import parse_body, parse_json
from producers.gateway.routes.usage import INSTANT, parse_time
from runtime.settings import load_settings

OK: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def document() -> dict[str, Any]:
    return create_app(load_settings()).openapi()


@pytest.fixture(scope="module")
def operation(document: dict[str, Any]) -> dict[str, Any]:
    chat: dict[str, Any] = document["paths"]["/v1/chat/completions"]["post"]
    assert document["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    return chat


def operations(document: dict[str, Any]) -> dict[str, tuple[str, str, dict[str, Any]]]:
    """operationId → (method, path, operation)."""
    return {op.get("operationId", f"{method} {path}"): (method, path, op)
            for path, item in document["paths"].items() for method, op in item.items()}


#: each create → the operations (by operationId) its answer's id leads to: every read, cancel and delete by id
CREATES = {
    "createChatCompletion": {"getChatCompletion", "getChatCompletionMessages", "cancelChatCompletion",
                             "deleteChatCompletion"},
    "createResponse": {"getResponse", "cancelResponse", "deleteResponse", "listResponseInputItems"},
    "createConversation": {"getConversation", "updateConversation", "listConversationItems", "deleteConversation",
                           "createConversationItems"},
}


@pytest.mark.parametrize("create", sorted(CREATES))
def test_each_create_links_to_every_operation_on_what_it_created(document: dict[str, Any], create: str) -> None:
    ops = operations(document)
    links = ops[create][2]["responses"]["200"]["links"]
    assert {link["operationId"] for link in links.values()} == CREATES[create]
    for link in links.values():
        target = ops[link["operationId"]][2]
        declared = {p["name"] for p in target.get("parameters", [])}
        assert set(link["parameters"]) <= declared, link
        assert {p["name"] for p in target["parameters"] if p["in"] == "path"} <= set(link["parameters"]), link


def test_every_link_names_an_operation_and_parameters_it_has(document: dict[str, Any]) -> None:
    ops = operations(document)
    linked = [link for _, _, op in ops.values() for answer in op["responses"].values()
              for link in answer.get("links", {}).values()]
    assert len(linked) >= 17
    for link in linked:
        assert link["operationId"] in ops, link
        target = ops[link["operationId"]][2]
        assert set(link["parameters"]) <= {p["name"] for p in target.get("parameters", [])}, link


def test_no_operation_declares_fastapis_422_and_every_error_is_openais(document: dict[str, Any]) -> None:
    for operation_id, (_, path, op) in operations(document).items():
        responses = op["responses"]
        assert "422" not in responses, operation_id
        for status, answer in responses.items():
            if status.startswith(("4", "5")):
                assert answer["content"]["application/json"]["schema"] == {
                    "$ref": "#/components/schemas/ErrorResponse"}, (operation_id, status)
        if "requestBody" in op:
            assert "413" in responses, operation_id
        if path.startswith("/v1/") and not path.startswith("/v1/admin"):
            assert {"401", "403", "503"} <= set(responses), operation_id
    assert "HTTPValidationError" not in document["components"]["schemas"]


def test_the_statuses_schemathesis_found_undocumented_are_declared(document: dict[str, Any]) -> None:
    paths = document["paths"]
    assert "404" in paths["/v1/models/{model_id}"]["get"]["responses"]
    assert "400" in paths["/v1/usage"]["get"]["responses"]
    # an empty POST creates an empty conversation, as OpenAI's: the body is optional
    assert paths["/v1/conversations"]["post"]["requestBody"]["required"] is False
    # found by the stateful phase: a response's stream resumed by id, and the cancel of one that ended
    assert set(paths["/v1/responses/{response_id}"]["get"]["responses"]["200"]["content"]) == {
        "application/json", "text/event-stream"}
    assert "409" in paths["/v1/responses/{response_id}/cancel"]["post"]["responses"]


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
    # at every depth: a message's, a part's and stream_options' fields
    {**OK, "messages": [{"role": "user", "content": "a", "cache_control": {"type": "ephemeral"}}]},
    {**OK, "messages": [{"role": "assistant", "content": "a", "tool_calls": [{"id": "c"}]}]},
    {**OK, "messages": [{"role": "assistant", "content": "a", "tool_calls": [], "refusal": None,
                         "annotations": [], "audio": None, "function_call": None}]},
    {**OK, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
    {**OK, "messages": [{"role": "user", "content": [{"type": "text", "text": "a", "cache_control": {}}]}]},
    {**OK, "stream": True, "stream_options": {"include_usage": True, "chunk": 1}},
    {**OK, "stream": True, "stream_options": {"include_obfuscation": False}},
    {**OK, "stream": True, "stream_options": {"include_obfuscation": True}},
    # the bounds of free text
    {**OK, "user": "u" * 256},
    {**OK, "user": "u" * 257},
    {**OK, "messages": [{"role": "user", "content": "a", "name": "n" * 65}]},
    {**OK, "stop": ["s" * 257]},
    # structured outputs: the rule between a format's type and its schema (schemathesis found it undeclared)
    {**OK, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}},
    {**OK, "response_format": {"type": "json_schema"}},
    {**OK, "response_format": {"type": "json_schema", "json_schema": None}},
    {**OK, "response_format": {"type": "text", "json_schema": {"name": "x"}}},
    {**OK, "response_format": {"type": "text", "json_schema": None}},
    {**OK, "response_format": {"type": "json_object"}},
    {**OK, "logit_bias": {"7": 100}},
    {**OK, "logit_bias": {"7": 101}},
    {**OK, "logit_bias": {"x": 1}},
]


@pytest.mark.parametrize("body", BODIES)
def test_the_schema_accepts_exactly_what_the_gateway_accepts(body: dict[str, Any]) -> None:
    validator = jsonschema_rs.validator_for(chat_request_schema())
    assert validator.is_valid(body) == accepted(orjson.dumps(body))


RESPONSE_OK: dict[str, Any] = {"model": "m", "input": "hi"}
ITEM = {"role": "user", "content": [{"type": "input_text", "text": "a"}]}
RESPONSE_BODIES: list[dict[str, Any]] = [
    RESPONSE_OK,
    {**RESPONSE_OK, "background": True},
    {**RESPONSE_OK, "background": True, "store": True},
    {**RESPONSE_OK, "background": True, "store": False},
    {**RESPONSE_OK, "background": False, "store": False},
    {**RESPONSE_OK, "conversation": "conv_1", "previous_response_id": "resp_1"},
    {**RESPONSE_OK, "conversation": None, "previous_response_id": "resp_1"},
    {**RESPONSE_OK, "conversation": {"id": "conv_1"}},
    {**RESPONSE_OK, "tools": []},
    {**RESPONSE_OK, "text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}},
    {**RESPONSE_OK, "text": {"format": {"type": "json_schema", "name": "x"}}},
    {**RESPONSE_OK, "text": {"format": {"type": "json_schema", "schema": {}}}},
    {**RESPONSE_OK, "text": {"format": {"type": "text", "description": ""}}},
    {**RESPONSE_OK, "text": {"format": {"type": "json_object", "strict": None}}},
    {**RESPONSE_OK, "text": {"format": {"type": "json_object"}}},
    {**RESPONSE_OK, "text": {"verbosity": "high"}},
    {**RESPONSE_OK, "tools": [{"type": "web_search"}]},
    {**RESPONSE_OK, "input": [ITEM]},
    {**RESPONSE_OK, "input": [{**ITEM, "content": [{"type": "input_image", "image_url": "x"}]}]},
    {**RESPONSE_OK, "input": [{**ITEM, "content": [{"type": "output_text", "text": "a", "annotations": []}]}]},
    {**RESPONSE_OK, "input": [{**ITEM, "content": [{"type": "output_text", "text": "a", "annotations": [{}]}]}]},
    {**RESPONSE_OK, "input": [{**ITEM, "content": [{"type": "input_text"}]}]},
    {**RESPONSE_OK, "input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]},
    {**RESPONSE_OK, "user": "u" * 257},
]


@pytest.mark.parametrize("body", RESPONSE_BODIES)
def test_the_response_schema_accepts_exactly_what_the_gateway_accepts(body: dict[str, Any]) -> None:
    validator = jsonschema_rs.validator_for(openapi_schema(ResponseCreate))
    try:
        parse_json(orjson.dumps(body), ResponseCreate)
        accepted = True
    except ApiError:
        accepted = False
    assert validator.is_valid(body) == accepted


@pytest.mark.parametrize("value", ["1795000000", "1795000000.5", "0", "2026-11-27", "2026-11-27T09:00",
                                   "2026-11-27T09:00:00Z", "2026-11-27 09:00:00.123+01:00", "", ".5", "1.",
                                   "20261127", "2026-11-27T09", "2026-13-01", "now", "2026-11-27T24:00"])
def test_usage_times_are_refused_exactly_when_the_document_says(value: str) -> None:
    declared = jsonschema_rs.validator_for({"type": "string", "pattern": INSTANT}).is_valid(value)
    try:
        parse_time(value, "start")
        parsed = True
    except ApiError:
        parsed = False
    assert parsed == declared


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
