"""``/tokenize`` and ``/detokenize`` (issue 39 item 7) with the model's real tokenizer: a chat's count is what its
chat completion's prompt is, text round-trips, bad input is a 400 naming the parameter, an unserved or disallowed
model is refused, and every call takes a read from the key's read bucket before its body is parsed."""

from __future__ import annotations

from typing import Any

import pytest

from producers.gateway.admission import Admission
from producers.gateway.errors import ApiError
from producers.gateway.local_limiter import LocalLimiter
from producers.gateway.prompt import PromptBuilder, to_event_messages
from producers.gateway.protocol import ChatCompletionRequest
from producers.gateway.routes.chat import parse_json
from producers.gateway.routes.tokenize import parse_tokenize
from producers.gateway.tokenization import Tokenization
from producers.gateway.tokenize_protocol import Detokenize
from runtime.settings import ModelSettings, TierTable
from schemas.events import LimitOverrides
from tests.fakes.gateway import Clock
from tests.fakes.tenancy import api_key

pytestmark = pytest.mark.unit
MODEL = ModelSettings().served_name
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is Kafka?"}]


@pytest.fixture(scope="module")
async def prompts() -> PromptBuilder:
    return await PromptBuilder.load(ModelSettings())


def service(prompts: PromptBuilder, clock: Clock | None = None) -> Tokenization:
    return Tokenization(prompts, Admission(LocalLimiter(clock=clock or Clock()), LocalLimiter(),
                                           TierTable.model_validate({})))


def body(**fields: Any) -> bytes:
    import orjson

    return orjson.dumps(fields)


async def tokenize(prompts: PromptBuilder, **fields: Any) -> Any:
    return await service(prompts).tokenize(api_key(), lambda: parse_tokenize(body(**fields)))


async def test_a_chats_count_is_the_prompt_its_chat_completion_sends(prompts: PromptBuilder) -> None:
    answer = await tokenize(prompts, model=MODEL, messages=CHAT)
    completion = ChatCompletionRequest.model_validate({"model": MODEL, "messages": CHAT})
    assert answer.tokens == prompts.render(to_event_messages(completion))
    assert answer.count == len(answer.tokens) and answer.max_model_len == prompts.card.max_model_len
    assert answer.token_strs is None


async def test_a_prompt_round_trips_through_detokenize_with_its_token_strings(prompts: PromptBuilder) -> None:
    answer = await tokenize(prompts, prompt="Hello world, streamed through Kafka.", return_token_strs=True)
    assert answer.token_strs is not None and len(answer.token_strs) == answer.count
    assert answer.token_strs[:2] == ["Hello", "Ġworld"]
    text = await service(prompts).detokenize(api_key(), lambda: parse_json(body(tokens=answer.tokens), Detokenize))
    assert text.prompt == "Hello world, streamed through Kafka."


async def test_continuing_the_final_message_leaves_it_open(prompts: PromptBuilder) -> None:
    opened = await tokenize(prompts, messages=[*CHAT, {"role": "assistant", "content": "Kafka is"}],
                            continue_final_message=True)
    closed = await tokenize(prompts, messages=[*CHAT, {"role": "assistant", "content": "Kafka is"}],
                            add_generation_prompt=False)
    text = prompts.decode(opened.tokens)
    assert text.endswith("<|im_start|>assistant\nKafka is")
    assert prompts.decode(closed.tokens).endswith("Kafka is<|im_end|>\n")


@pytest.mark.parametrize(("fields", "param"), [
    ({"prompt": 3}, "prompt"),
    ({"prompt": "x", "messages": CHAT}, "prompt"),  # a chat body has no prompt
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"prompt": "x", "chat_template": "{{ x }}"}, "chat_template"),  # vLLM's; not served here
])
async def test_a_malformed_tokenize_body_is_a_400_naming_the_parameter(prompts: PromptBuilder, fields: dict[str, Any],
                                                                       param: str) -> None:
    with pytest.raises(ApiError) as raised:
        await tokenize(prompts, **fields)
    assert (raised.value.status, raised.value.param) == (400, param)


async def test_both_endings_at_once_is_a_400(prompts: PromptBuilder) -> None:
    with pytest.raises(ApiError) as raised:
        await tokenize(prompts, messages=CHAT, continue_final_message=True, add_generation_prompt=True)
    assert raised.value.status == 400 and "continue_final_message" in raised.value.message


async def test_an_id_outside_the_vocabulary_is_a_400_naming_it(prompts: PromptBuilder) -> None:
    size = prompts.vocabulary_size
    with pytest.raises(ApiError) as raised:
        await service(prompts).detokenize(api_key(), lambda: parse_json(body(tokens=[1, size]), Detokenize))
    assert (raised.value.status, raised.value.param) == (400, "tokens") and str(size) in raised.value.message
    for tokens in ([-1], [1.5], ["1"]):
        with pytest.raises(ApiError) as raised:
            parse_json(body(tokens=tokens), Detokenize)
        assert raised.value.status == 400


async def test_an_unserved_model_is_404_and_a_disallowed_one_403(prompts: PromptBuilder) -> None:
    with pytest.raises(ApiError) as raised:
        await tokenize(prompts, model="gpt-4o", prompt="x")
    assert (raised.value.status, raised.value.code) == (404, "model_not_found")
    only_other = api_key(models=["another-model"])
    with pytest.raises(ApiError) as raised:
        await service(prompts).tokenize(only_other, lambda: parse_tokenize(body(model=MODEL, prompt="x")))
    assert (raised.value.status, raised.value.code) == (403, "model_not_allowed")


async def test_each_call_takes_a_read_and_past_the_bucket_nothing_is_parsed(prompts: PromptBuilder) -> None:
    tokenization = service(prompts)
    key = api_key(tier="enterprise", limits=LimitOverrides(requests_per_minute=2))
    parsed: list[bool] = []

    def parse() -> Any:
        parsed.append(True)
        return parse_tokenize(body(prompt="x"))

    await tokenization.tokenize(key, parse)
    await tokenization.detokenize(key, lambda: parse_json(body(tokens=[1]), Detokenize))
    with pytest.raises(ApiError) as raised:
        await tokenization.tokenize(key, parse)
    assert (raised.value.status, raised.value.code) == (429, "rate_limit_exceeded")
    assert parsed == [True]


async def test_a_long_prompt_is_tokenized_whole(prompts: PromptBuilder) -> None:
    text = "word " * 5000  # past what is tokenized on the event loop: a thread does it
    answer = await tokenize(prompts, prompt=text)
    assert answer.count == len(prompts.encode(text, add_special_tokens=True)) >= 5000
