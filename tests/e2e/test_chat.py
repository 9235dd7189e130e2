"""The official openai SDK against the platform: gateway → Kafka → vLLM worker → Kafka → SSE relay."""

from __future__ import annotations

import openai
import pytest

from runtime.settings import Settings
from tests.e2e.conftest import MODEL, QUESTION, token_events, usage_events
from tests.helpers import wait_for

pytestmark = pytest.mark.e2e


def streamed_text(chunks: list) -> str:  # type: ignore[type-arg]
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_stream_and_non_stream_answer_the_same_at_temperature_zero(client: openai.OpenAI) -> None:
    full = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=32)
    chunks = list(client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=32,
                                                 stream=True))
    answer = full.choices[0].message.content
    assert "Paris" in answer
    assert streamed_text(chunks) == answer
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason == "stop"
    assert all(c.id == chunks[0].id and c.object == "chat.completion.chunk" for c in chunks)
    assert full.id.startswith("chatcmpl-") and full.object == "chat.completion" and full.model == MODEL
    usage = full.usage
    assert usage.prompt_tokens > 10 and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


async def test_usage_chunk_and_every_token_went_through_the_token_topic(client: openai.OpenAI,
                                                                          stack: Settings) -> None:
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=32, stream=True,
        stream_options={"include_usage": True}))
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert all(c.usage is None for c in chunks[:-1])
    # The client got the final event from the relay, so the token log already holds it (read_uncommitted).
    events = await token_events(stack, last.id)
    assert [e.seq for e in events] == list(range(len(events)))
    final = events[-1]
    assert final.finish_reason == "stop" and final.usage is not None
    # The usage chunk is the final event's usage, as the worker recorded it.
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (last.usage.prompt_tokens,
                                                                          last.usage.completion_tokens)
    assert "".join(e.text for e in events) == streamed_text(chunks)
    assert sum(len(e.token_ids) for e in events) == last.usage.completion_tokens
    # The usage event commits in the worker's transaction, which the client does not wait for.
    committed = await wait_for(lambda: usage_events(stack, last.id), timeout_s=30)
    assert committed, f"no committed usage event for {last.id}"
    (usage,) = committed
    assert (usage.prompt_tokens, usage.completion_tokens) == (last.usage.prompt_tokens, last.usage.completion_tokens)


def test_seed_makes_sampling_reproducible(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}],
                                           temperature=1.0, seed=seed, max_tokens=24)
        return r.choices[0].message.content or ""

    assert sample(7) == sample(7)
    assert len({sample(s) for s in (1, 2, 3)}) >= 2


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_max_tokens_is_honoured(client: openai.OpenAI, field: str) -> None:
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, **{field: 5},
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5


def test_stop_sequences_end_the_answer(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=32, stop=["."])
    assert r.choices[0].finish_reason == "stop"
    assert "Paris" in r.choices[0].message.content and "." not in r.choices[0].message.content


def test_models_are_listed_with_their_context_length(client: openai.OpenAI) -> None:
    (model,) = client.models.list().data
    assert model.id == MODEL and model.model_extra["max_model_len"] == 2048
    assert client.models.retrieve(MODEL).id == MODEL
