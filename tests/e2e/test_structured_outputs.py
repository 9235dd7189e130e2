"""Structured outputs through the whole pipeline with the real model (issue 39 item 2): the official SDK's
``chat.completions.parse()`` and ``responses.parse()`` with a pydantic model get an object that validates, greedy
and sampled, streamed and not; JSON mode answers a JSON object; a stored response reports its format; a token
biased by 100 is all the model says, and one biased by -100 does not start the answer. (Schemas refused before Kafka:
test_bad_input.py.)"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.e2e.conftest import MODEL

pytestmark = pytest.mark.e2e

ASK = [{"role": "user", "content": "Invent a fictional person: give their name, age and two hobbies."}]


class Person(BaseModel):
    name: str = Field(max_length=40)
    age: int
    hobbies: list[str] = Field(min_length=2, max_length=2)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_parse_with_a_pydantic_model_gets_an_object_that_validates(client: openai.OpenAI, temperature: float) -> None:
    completion = client.chat.completions.parse(model=MODEL, messages=ASK, response_format=Person,  # type: ignore[arg-type]
                                               max_tokens=200, temperature=temperature)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(choice.message.parsed, Person), choice.message.content
    assert len(choice.message.parsed.hobbies) == 2


def test_a_streamed_structured_output_validates_against_its_schema(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                               "population": {"type": "integer", "minimum": 0}},
              "required": ["city", "population"], "additionalProperties": False}
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name a city and its population."}], stream=True,
        max_tokens=100, temperature=0.7, response_format={"type": "json_schema",
                                                           "json_schema": {"name": "City", "schema": schema}})
    text, finish = "", None
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert finish == "stop", text
    jsonschema.validate(json.loads(text), schema)


def test_json_mode_answers_a_json_object(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe a cat as JSON."}], max_tokens=120,
        temperature=0.0, response_format={"type": "json_object"})
    choice = answer.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(json.loads(choice.message.content or ""), dict)


def test_responses_parse_gets_a_validated_object_and_the_stored_response_reports_its_format(
        client: openai.OpenAI) -> None:
    parsed = client.responses.parse(model=MODEL, input=ASK[0]["content"], text_format=Person, max_output_tokens=200,
                                    temperature=0.0)
    assert parsed.status == "completed", parsed.output_text
    assert isinstance(parsed.output_parsed, Person), parsed.output_text
    stored = client.responses.retrieve(parsed.id)
    assert stored.text is not None and stored.text.format is not None
    fmt = stored.text.format.model_dump(by_alias=True)
    assert (fmt["type"], fmt["name"], set(fmt["schema"]["properties"])) == ("json_schema", "Person",
                                                                          {"name", "age", "hobbies"})
    assert stored.output_text == parsed.output_text


def test_a_token_biased_by_100_is_all_the_model_says_and_one_biased_by_minus_100_never_starts_it(
        client: openai.OpenAI) -> None:
    from transformers import AutoTokenizer

    from runtime.settings import ModelSettings

    tokenizer = AutoTokenizer.from_pretrained(str(ModelSettings().path))
    prompt = [{"role": "user", "content": "What is the capital of France?"}]
    banana = tokenizer.encode(" banana", add_special_tokens=False)
    assert len(banana) == 1
    forced = client.chat.completions.create(model=MODEL, messages=prompt, max_tokens=8, temperature=0.0,  # type: ignore[arg-type]
                                            logit_bias={str(banana[0]): 100})
    assert forced.choices[0].message.content == " banana" * 8
    plain = client.chat.completions.create(model=MODEL, messages=prompt, max_tokens=8, temperature=0.0)  # type: ignore[arg-type]
    text = plain.choices[0].message.content or ""
    first = tokenizer.encode(text, add_special_tokens=False)[0]
    banned = client.chat.completions.create(model=MODEL, messages=prompt, max_tokens=8, temperature=0.0,  # type: ignore[arg-type]
                                            logit_bias={str(first): -100})
    assert not (banned.choices[0].message.content or "").startswith(tokenizer.decode([first])), text
