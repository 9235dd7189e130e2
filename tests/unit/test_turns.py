"""A turn's history fitted to the context, with the served model's real tokenizer and chat template, and what a
recorded turn writes (the conversation writer's mappings)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from producers.gateway.errors import ApiError
from producers.gateway.prompt import PromptBuilder
from producers.gateway.turns import TurnAsk, TurnPlanner
from runtime.settings import GatewaySettings, ModelSettings, RedisSettings
from schemas.events import ChatMessage, StoredCompletion, TokenUsage, Turn
from schemas.ids import input_item_id, output_item_id
from stream_processors.store.conversations import Item
from stream_processors.store.responses import StoredResponse
from stream_processors.store.turns import items_of, response_of

NOW = datetime(2026, 11, 24, 12, 0, tzinfo=UTC)
FILLER = " ".join(["the quick brown fox jumps over the lazy dog"] * 12)  # about 120 tokens


@pytest.fixture(scope="module")
async def prompts() -> PromptBuilder:
    return await PromptBuilder.load(ModelSettings())


class Conversations:
    def __init__(self, history: list[Item]) -> None:
        self._history = history

    async def get(self, conversation_id: str, org_id: str) -> object | None:
        return object() if org_id == "org" else None

    async def history(self, conversation_id: str, *, max_items: int) -> list[Item]:
        return self._history[-max_items:]


class Responses:
    def __init__(self, rows: list[StoredResponse]) -> None:
        self._rows = {r.response_id: r for r in rows}

    async def get(self, response_id: str, org_id: str) -> StoredResponse | None:
        row = self._rows.get(response_id)
        return row if row is not None and row.org_id == org_id else None


class NoRedis:
    async def get(self, key: str) -> None:
        return None


async def _nothing_in_flight(response_id: str, org_id: str) -> bool:
    return False


def planner(prompts: PromptBuilder, history: list[Item] | None = None,
            responses: list[StoredResponse] | None = None) -> TurnPlanner:
    return TurnPlanner(prompts, Conversations(history or []), Responses(responses or []),  # type: ignore[arg-type]
                       NoRedis(), RedisSettings(), GatewaySettings(instance_id="gw"),  # type: ignore[arg-type]
                       in_flight=_nothing_in_flight)


def turns(count: int) -> list[Item]:
    return [Item(f"msg_{n}_{role}", role, f"{n}: {FILLER}", NOW, i)
            for n in range(count) for i, role in enumerate(("user", "assistant"))]


def ask(**fields: Any) -> TurnAsk:
    return TurnAsk(**{"api": "responses", "org_id": "org", "new_input": [ChatMessage(role="user", content="Hi")],
                      "conversation_id": "conv_1", **fields})


async def test_a_history_that_fits_is_kept_whole(prompts: PromptBuilder) -> None:
    planned = await planner(prompts, turns(3)).plan(ask(instructions="Be brief.", truncation="auto"))
    assert planned.turn.truncated_items == 0 and len(planned.messages) == 1 + 6 + 1
    assert planned.prompt_ids == prompts.render(planned.messages)
    assert planned.turn.input_count == 1 and planned.turn.instructions == "Be brief."


async def test_the_oldest_whole_turns_are_dropped_to_fit(prompts: PromptBuilder) -> None:
    history = turns(20)  # about 4,800 tokens, the context is 2,048
    planned = await planner(prompts, history).plan(ask(instructions="Be brief.", truncation="auto",
                                                       max_output_tokens=100))
    dropped = planned.turn.truncated_items
    assert dropped > 0 and dropped % 2 == 0
    assert planned.messages[0].content == "Be brief." and planned.messages[-1].content == "Hi"
    assert planned.messages[1].content.startswith(f"{dropped // 2}: ") and planned.messages[1].role == "user"
    assert len(planned.prompt_ids) + 100 <= 2048
    # the most history that fits: one more turn would not
    one_more = [planned.messages[0], *[ChatMessage(role=i.role, content=i.text) for i in history[dropped - 2:]],
                planned.messages[-1]]
    assert len(prompts.render(one_more)) + 100 > 2048


async def test_without_max_output_tokens_the_answer_keeps_its_reserve(prompts: PromptBuilder) -> None:
    planned = await planner(prompts, turns(20)).plan(ask(truncation="auto"))
    assert len(planned.prompt_ids) + GatewaySettings(instance_id="gw").output_reserve_tokens <= 2048


async def test_disabled_truncation_keeps_everything_and_leaves_the_limit_to_sampling(prompts: PromptBuilder) -> None:
    planned = await planner(prompts, turns(20)).plan(ask())
    assert planned.turn.truncated_items == 0 and len(planned.messages) == 41 and len(planned.prompt_ids) > 2048


async def test_instructions_and_input_that_cannot_fit_are_refused(prompts: PromptBuilder) -> None:
    huge = " ".join(["word"] * 3000)
    with pytest.raises(ApiError) as refused:
        await planner(prompts, turns(2)).plan(ask(instructions=huge, truncation="auto"))
    assert refused.value.status == 400 and refused.value.code == "context_length_exceeded"


async def test_another_orgs_conversation_is_not_found(prompts: PromptBuilder) -> None:
    with pytest.raises(ApiError) as refused:
        await planner(prompts).plan(ask(org_id="other"))
    assert refused.value.status == 404


def response(response_id: str, previous: str | None, text: str, status: str = "completed",
             org_id: str = "org") -> StoredResponse:
    return StoredResponse(response_id=response_id, org_id=org_id, key_id="k", user=None, model="m",
                          created_at=NOW, status=status, input_items=[{"role": "user", "content": f"q{text}"}],
                          output_text=text, prompt_tokens=1, completion_tokens=1, cached_tokens=0,
                          previous_response_id=previous)


async def test_a_previous_response_chain_is_the_history_oldest_first(prompts: PromptBuilder) -> None:
    rows = [response("resp_1", None, "a"), response("resp_2", "resp_1", "b", status="failed"),
            response("resp_3", "resp_2", "c")]
    planned = await planner(prompts, responses=rows).plan(
        ask(conversation_id=None, previous_response_id="resp_3"))
    assert [(m.role, m.content) for m in planned.messages] == [
        ("user", "qa"), ("assistant", "a"), ("user", "qc"), ("assistant", "c"), ("user", "Hi")]


async def test_a_previous_response_of_another_org_is_not_found(prompts: PromptBuilder) -> None:
    with pytest.raises(ApiError) as refused:
        await planner(prompts, responses=[response("resp_1", None, "a", org_id="other")]).plan(
            ask(conversation_id=None, previous_response_id="resp_1"))
    assert refused.value.status == 404 and refused.value.param == "previous_response_id"


def recorded(finish_reason: str, text: str, *, api: str = "responses", store: bool = True,
             error: str | None = None) -> StoredCompletion:
    return StoredCompletion(
        completion_id="resp_abc", org_id="org", key_id="k", model="m", created_at=NOW,
        messages=[ChatMessage(role="user", content="one"), ChatMessage(role="user", content="two")], text=text,
        finish_reason=finish_reason, usage=TokenUsage(prompt_tokens=5, completion_tokens=2), error=error,
        listed=False, conversation_id="conv_1", turn=Turn(api=api, input_count=2, store=store))


def test_an_answered_turn_appends_its_inputs_then_its_answer() -> None:
    mapped = items_of(recorded("stop", "hello"))
    assert mapped is not None
    inputs, answer = mapped
    assert [(i.item_id, i.role, i.text, i.seq) for i in inputs] == [
        (input_item_id("resp_abc", 0), "user", "one", 0), (input_item_id("resp_abc", 1), "user", "two", 1)]
    assert (answer.item_id, answer.role, answer.text, answer.seq, answer.status) == (
        output_item_id("resp_abc"), "assistant", "hello", 2, "completed")
    assert items_of(recorded("stop", "hello")) == mapped  # a redelivery writes the same rows


@pytest.mark.parametrize(("finish", "text", "error", "appended"), [
    ("length", "cut", None, True), ("content_filter", "some", None, True), ("content_filter", "", None, False),
    ("cancelled", "part", None, False), ("error", "", "boom", False), ("stop", "x", "boom", False)])
def test_only_answered_turns_are_appended(finish: str, text: str, error: str | None, appended: bool) -> None:
    assert (items_of(recorded(finish, text, error=error)) is not None) == appended


def test_a_stored_response_records_how_its_turn_ended() -> None:
    row = response_of(recorded("length", "cut"))
    assert row is not None and row.status == "incomplete" and row.incomplete_reason == "max_output_tokens"
    assert row.input_items == [{"role": "user", "content": "one"}, {"role": "user", "content": "two"}]
    failed = response_of(recorded("error", "", error="boom"))
    assert failed is not None and failed.status == "failed" and failed.error == "boom"
    assert response_of(recorded("stop", "x", store=False)) is None
    assert response_of(recorded("stop", "x", api="chat")) is None
