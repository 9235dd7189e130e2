"""Request validation and the OpenAI error shape (no server needed)."""

from __future__ import annotations

import pytest

from producers.gateway.errors import ApiError
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


def test_vllm_extensions_and_unknown_fields() -> None:
    body = parse_body(b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "ignore_eos": true,'
                      b' "min_tokens": 3, "top_k": 5, "repetition_penalty": 1.1, "logit_bias": {}}')
    assert (body.ignore_eos, body.min_tokens, body.top_k, body.repetition_penalty) == (True, 3, 5, 1.1)
    assert body.unknown_fields() == ["logit_bias"]


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    body = parse_body(b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 9,'
                      b' "max_completion_tokens": 4}')
    assert body.requested_max_tokens == 4
