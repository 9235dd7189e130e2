"""Structured outputs and token biases at the gateway (issue 39 items 2 and 3): chat's ``response_format`` and the
Responses API's ``text.format`` become the JSON schema the worker decodes under, a schema the engine's grammar
library cannot build is a 400 naming it before anything is admitted, an unseeded sample gets the seed its replay
needs, and a biased token the model does not have is refused. The model's real tokenizer; no service."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from inference_workers.resume import EmittedPrefix, plan
from producers.gateway import structured
from producers.gateway.errors import ApiError
from producers.gateway.prompt import PromptBuilder, replayable_seed
from producers.gateway.protocol import ChatCompletionRequest
from producers.gateway.responses_protocol import ResponseCreate
from producers.gateway.routes.chat import parse_body, parse_json
from producers.gateway.structured import SchemaChecker
from runtime.settings import ModelSettings
from schemas.events import ChatMessage, ChatRequest, ReplyTo, SamplingSpec

pytestmark = pytest.mark.unit
CHAT = {"model": "m", "messages": [{"role": "user", "content": "Who?"}]}
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def chat(**fields: Any) -> ChatCompletionRequest:
    return parse_body(orjson.dumps({**CHAT, **fields}))


def response(**fields: Any) -> ResponseCreate:
    return parse_json(orjson.dumps({"model": "m", "input": "Who?", **fields}), ResponseCreate)


def refused(parse: Any) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse()
    assert info.value.status == 400
    return info.value


async def checked(wanted: tuple[dict[str, Any], str, str | None] | None) -> str | None:
    if wanted is None:
        return None
    schema, param, name = wanted
    return await SchemaChecker().check(schema, param=param, name=name)


@pytest.fixture(scope="module")
async def prompts() -> PromptBuilder:
    return await PromptBuilder.load(ModelSettings())


# --- what a request asks for --------------------------------------------------------------------------------

async def test_a_json_schema_is_passed_on_as_given_and_json_mode_as_any_object() -> None:
    as_sdk_parse_sends = {"type": "json_schema", "json_schema": {"name": "Person", "schema": PERSON, "strict": True}}
    assert orjson.loads(await checked(chat(response_format=as_sdk_parse_sends).output_schema) or "") == PERSON
    assert await checked(chat(response_format={"type": "json_object"}).output_schema) == '{"type":"object"}'
    assert chat(response_format={"type": "text"}).output_schema is None and chat().output_schema is None


async def test_the_responses_text_format_is_flattened_and_echoed_as_given() -> None:
    fmt = {"type": "json_schema", "name": "Person", "schema": PERSON, "strict": True}
    body = response(text={"format": fmt})
    assert orjson.loads(await checked(body.output_schema) or "") == PERSON
    assert body.text_format is not None and body.text_format.echo() == fmt
    assert response(text={"format": {"type": "text"}}).output_schema is None
    assert response(text={"format": {"type": "json_object"}}).output_schema == ({"type": "object"}, "text.format",
                                                                                None)


@pytest.mark.parametrize(("fields", "param"), [
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_object", "json_schema": {"name": "x"}}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "not a name!", "schema": {}}}},
     "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "{}"}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "grammar", "grammar": "x"}}, "response_format.grammar"),
    ({"response_format": {"type": "regex"}}, "response_format.type"),
])
def test_a_malformed_response_format_is_a_400_naming_the_field(fields: dict[str, Any], param: str) -> None:
    assert refused(lambda: chat(**fields)).param == param


@pytest.mark.parametrize(("text", "param", "code"), [
    ({"format": {"type": "json_schema", "schema": PERSON}}, "text.format.name", "missing_required_parameter"),
    ({"format": {"type": "json_schema", "name": "Person"}}, "text.format.schema", "missing_required_parameter"),
    ({"format": {"type": "json_object", "schema": PERSON}}, "text.format.schema", "invalid_value"),
    ({"verbosity": "low"}, "text.verbosity", "unsupported_parameter"),
])
def test_a_malformed_text_format_is_a_400_naming_the_field(text: dict[str, Any], param: str, code: str) -> None:
    err = refused(lambda: response(text=text))
    assert (err.param, err.code) == (param, code)


# --- what the engine can decode -------------------------------------------------------------------------------

@pytest.mark.parametrize(("schema", "why"), [
    ({"type": "array", "items": {"type": "string"}, "uniqueItems": True}, "uniqueItems"),
    ({"type": "frob"}, "frob"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, "missing"),
    ({"type": "string", "minLength": 5, "maxLength": 2}, "minLength"),
])
async def test_a_schema_the_engine_cannot_decode_under_is_a_400_with_the_reason(schema: dict[str, Any],
                                                                              why: str) -> None:
    body = chat(response_format={"type": "json_schema", "json_schema": {"name": "Shape", "schema": schema}})
    with pytest.raises(ApiError) as info:
        await checked(body.output_schema)
    err = info.value
    assert (err.status, err.param, err.code) == (400, "response_format.json_schema.schema", "invalid_json_schema")
    assert "'Shape'" in err.message and why in err.message


async def test_a_schema_nested_beyond_the_bound_is_refused_before_any_grammar_is_built(
        monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[str] = []
    monkeypatch.setattr(structured, "grammar_error", lambda text: built.append(text) or "")
    deep: dict[str, Any] = {"type": "string"}
    for _ in range(structured.MAX_NESTING):
        deep = {"type": "array", "items": deep}
    with pytest.raises(ApiError) as info:
        await SchemaChecker().check(deep, param="response_format.json_schema.schema")
    assert "nest" in info.value.message and built == []
    await SchemaChecker().check(deep["items"], param="response_format.json_schema.schema")  # a level less passes
    assert len(built) == 1


async def test_verdicts_are_remembered_by_schema_and_the_least_recently_used_forgotten(
        monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[str] = []
    monkeypatch.setattr(structured, "grammar_error", lambda text: built.append(text) or "")
    checker = SchemaChecker(remembered=2)
    a, b, c = ({"type": t} for t in ("string", "integer", "boolean"))
    for schema in (a, b, a, c, a, b):
        await checker.check(schema, param="p")
    # b was the least recently used when c came, so it was forgotten and built again
    assert [orjson.loads(t)["type"] for t in built] == ["string", "integer", "boolean", "integer"]


async def test_every_new_schema_is_checked_off_the_event_loop_a_cached_one_on_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    threads: list[str] = []
    monkeypatch.setattr(structured, "grammar_error", lambda text: threads.append(threading.current_thread().name)
                        or "")
    # a few hundred bytes of allOf over anyOf take llguidance about a second: size says nothing of the cost
    small = {"allOf": [{"anyOf": [{"type": "object", "properties": {f"a{i}": {"type": "string"}}},
                                  {"type": "object", "properties": {f"b{i}": {"type": "integer"}}}]}
                       for i in range(11)]}
    checker = SchemaChecker()
    await checker.check(small, param="p")
    await checker.check(small, param="p")
    assert len(threads) == 1 and threads[0] != threading.current_thread().name


@pytest.mark.timeout(10)
async def test_array_bounds_beyond_the_bound_are_refused_before_any_grammar_is_built(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # llguidance spells maxItems out item by item: 10**7 takes it a minute, a minItems of 2**31 - 1 all the memory
    huge = {"type": "array", "items": {"type": "integer"}, "maxItems": 10**7}
    with pytest.raises(ApiError) as info:
        await SchemaChecker().check(huge, param="response_format.json_schema.schema")
    assert (info.value.param, info.value.code) == ("response_format.json_schema.schema", "invalid_json_schema")
    assert "maxItems" in info.value.message

    built: list[str] = []
    monkeypatch.setattr(structured, "grammar_error", lambda text: built.append(text) or "")
    half = structured.MAX_ARRAY_BOUNDS // 2
    spread = {"type": "object", "properties": {
        "a": {"type": "array", "minItems": half, "maxItems": half},
        "b": {"type": "array", "maxItems": 1, "items": {"type": "array", "minItems": -10**7}}}}
    with pytest.raises(ApiError):  # the bounds of all its arrays add up, and a negative one takes nothing off
        await SchemaChecker().check(spread, param="p")
    assert built == []
    await SchemaChecker().check(spread["properties"]["a"], param="p")  # at the bound passes
    assert len(built) == 1


# --- the sampling the worker gets -------------------------------------------------------------------------------

def test_an_unseeded_structured_sample_gets_a_seed_and_a_seeded_or_greedy_one_keeps_its_own() -> None:
    seeds = {replayable_seed(None, 0.8, '{"type":"object"}') for _ in range(8)}
    assert None not in seeds and len(seeds) == 8 and all(0 <= s < 2**63 for s in seeds if s is not None)
    assert replayable_seed(7, 0.8, '{"type":"object"}') == 7
    assert replayable_seed(-1, 0.8, '{"type":"object"}') not in (None, -1)  # vLLM reads -1 as unseeded
    assert replayable_seed(None, 0.0, '{"type":"object"}') is None
    assert replayable_seed(None, 0.8, None) is None  # free text continues from the prefix, it needs none


def test_a_structured_output_taken_over_is_replayed_from_its_prompt_not_continued() -> None:
    sampling = SamplingSpec(max_tokens=20, temperature=0.0, json_schema='{"type":"object"}')
    request = ChatRequest(request_id="r", created_at="2026-11-27T00:00:00Z", org_id="o", key_id="k", tier="free",
                          model="m", messages=[ChatMessage(role="user", content="x")], prompt_token_ids=[1, 2, 3],
                          sampling=sampling, stream=True, reply=ReplyTo(partition=0, gateway_id="g"))
    emitted = EmittedPrefix([10, 11], '{"', attempt=1)
    planned = plan(request, emitted)
    assert planned.prompt_token_ids == [1, 2, 3] and planned.replay == emitted
    free = plan(request.model_copy(update={"sampling": sampling.model_copy(update={"json_schema": None})}), emitted)
    assert free.prompt_token_ids == [1, 2, 3, 10, 11] and not free.replay.tokens


async def test_logit_bias_reaches_the_spec_and_a_token_the_model_lacks_is_refused(prompts: PromptBuilder) -> None:
    spec = prompts.sampling(chat(logit_bias={"42": -100, "7": 2.5}, max_tokens=4), 10)
    assert spec.logit_bias == {"42": -100.0, "7": 2.5}
    beyond = str(prompts.vocabulary_size)
    err = refused(lambda: prompts.sampling(chat(logit_bias={beyond: 1}, max_tokens=4), 10))
    assert (err.param, err.code) == ("logit_bias", "invalid_value") and beyond in err.message


@pytest.mark.parametrize(("bias", "param"), [
    ({"x1": 1}, "logit_bias.x1"),
    ({"-3": 1}, "logit_bias.-3"),
    ({"5": 101}, "logit_bias.5"),
    ({"5": "1"}, "logit_bias.5"),
])
def test_a_malformed_logit_bias_is_a_400_naming_it(bias: dict[str, Any], param: str) -> None:
    assert refused(lambda: chat(logit_bias=bias)).param == param


def test_too_many_biased_tokens_are_refused() -> None:
    assert refused(lambda: chat(logit_bias={str(i): 1 for i in range(301)})).param == "logit_bias"


async def test_a_schema_setting_the_grammars_own_options_is_refused() -> None:
    lenient = {"type": "object", "x-guidance": {"lenient": True, "whitespace_flexible": True}}
    with pytest.raises(ApiError) as info:
        await SchemaChecker().check(lenient, param="response_format.json_schema.schema")
    assert (info.value.param, info.value.code) == ("response_format.json_schema.schema", "invalid_json_schema")
    assert "x-guidance" in info.value.message
