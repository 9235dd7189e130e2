"""Chat template + context-length rules, with the served model's real tokenizer (a local folder)."""

from __future__ import annotations

import pytest

from producers.gateway.errors import ApiError
from producers.gateway.prompt import PromptBuilder, to_event_messages
from producers.gateway.routes.chat import parse_body
from runtime.settings import ModelSettings


@pytest.fixture(scope="module")
async def prompts() -> PromptBuilder:
    return await PromptBuilder.load(ModelSettings())


def request(**extra: object) -> bytes:
    import orjson

    return orjson.dumps({"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "hi"}], **extra})


async def test_chat_template_is_applied(prompts: PromptBuilder) -> None:
    body = parse_body(request())
    ids = prompts.render(to_event_messages(body))
    text = prompts._tokenizer.decode(ids)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


async def test_developer_role_renders_as_system(prompts: PromptBuilder) -> None:
    messages = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "x"}]
    body = parse_body(request(messages=messages))
    text = prompts._tokenizer.decode(prompts.render(to_event_messages(body)))
    assert text.startswith("<|im_start|>system\nbe brief<|im_end|>")


async def test_max_tokens_defaults_to_the_rest_of_the_context(prompts: PromptBuilder) -> None:
    spec = prompts.sampling(parse_body(request()), prompt_tokens=48)
    assert spec.max_tokens == 2048 - 48 and spec.temperature == 1.0 and spec.top_k == 0


async def test_prompt_plus_completion_beyond_the_context_is_rejected(prompts: PromptBuilder) -> None:
    with pytest.raises(ApiError) as info:
        prompts.sampling(parse_body(request(max_tokens=2000)), prompt_tokens=100)
    assert (info.value.status, info.value.param, info.value.code) == (400, "max_tokens", "context_length_exceeded")
    assert "2100 tokens (100 in the messages, 2000 in the completion)" in info.value.message


async def test_prompt_longer_than_the_context_is_rejected(prompts: PromptBuilder) -> None:
    with pytest.raises(ApiError) as info:
        prompts.sampling(parse_body(request()), prompt_tokens=2048)
    assert (info.value.param, info.value.code) == ("messages", "context_length_exceeded")


async def test_min_tokens_above_max_tokens_is_rejected(prompts: PromptBuilder) -> None:
    with pytest.raises(ApiError) as info:
        prompts.sampling(parse_body(request(max_tokens=3, min_tokens=5)), prompt_tokens=10)
    assert info.value.param == "min_tokens"


async def test_short_and_long_prompts_render_the_same_ids_inline_or_in_a_thread(prompts: PromptBuilder) -> None:
    import orjson

    from producers.gateway.prompt import INLINE_RENDER_CHARS

    for text in ("Hi.", "word " * (INLINE_RENDER_CHARS // 5 + 10)):
        body = parse_body(orjson.dumps({"model": "m", "messages": [{"role": "user", "content": text}]}))
        messages = to_event_messages(body)
        assert len(await prompts.tokens(messages)) > (1 if len(text) < 10 else INLINE_RENDER_CHARS // 5)
        assert await prompts.tokens(messages) == prompts.render(messages)
