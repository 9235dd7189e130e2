"""Conversation items a client adds and deletes, and a response's input items (issue 39 item 6), with the official
SDK through the real gateway and Cassandra: what the Agents SDK's ``OpenAIConversationsSession`` does (``add_items``:
``conversations.items.create``; ``pop_item``: list the newest, delete it) works, added items are the next turn's
history and a deleted one is not, ``responses.input_items.list`` pages a response's input with cursors, and these
writes are requests of the key's rate limit."""

from __future__ import annotations

import httpx
import openai
import pytest

from producers.tenancy.admin import Limits
from tests.conftest import SESSION, Caller
from tests.e2e.conftest import MODEL

pytestmark = pytest.mark.e2e


def test_items_added_and_popped_as_the_agents_session_does_shape_the_next_turn(client: openai.OpenAI) -> None:
    conversation = client.conversations.create()
    added = client.conversations.items.create(conversation.id, items=[
        {"type": "message", "role": "user", "content": "My name is Ada."},
        {"type": "message", "role": "assistant", "content": "Nice to meet you, Ada."},
        {"type": "message", "role": "user", "content": "This message will be popped."},
    ])
    assert [item.role for item in added.data] == ["user", "assistant", "user"]  # type: ignore[union-attr]
    assert added.first_id == added.data[0].id and added.last_id == added.data[-1].id

    # pop_item: the newest item, read and deleted
    newest = client.conversations.items.list(conversation.id, limit=1, order="desc").data[0]
    assert newest.id == added.data[-1].id
    deleted = client.conversations.items.delete(newest.id, conversation_id=conversation.id)
    assert deleted.id == conversation.id
    with pytest.raises(openai.NotFoundError):
        client.conversations.items.retrieve(newest.id, conversation_id=conversation.id)
    with pytest.raises(openai.NotFoundError):  # once
        client.conversations.items.delete(newest.id, conversation_id=conversation.id)

    turn = client.responses.create(model=MODEL, input="What is my name?", conversation=conversation.id,
                                   max_output_tokens=8, temperature=0)
    history = [item.content[0].text for item in  # type: ignore[union-attr]
               client.conversations.items.list(conversation.id, order="asc").data]
    assert history == ["My name is Ada.", "Nice to meet you, Ada.", "What is my name?", turn.output_text]
    # the prompt was the two items kept and the new input: the popped message is not in it
    alone = client.responses.create(model=MODEL, input=[
        {"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": "Nice to meet you, Ada."},
        {"role": "user", "content": "What is my name?"}], max_output_tokens=8, temperature=0)
    assert turn.usage is not None and alone.usage is not None
    assert turn.usage.input_tokens == alone.usage.input_tokens


def test_a_responses_input_items_page_with_cursors_both_ways(client: openai.OpenAI) -> None:
    inputs = [{"role": "user", "content": f"line {n}"} for n in range(5)]
    response = client.responses.create(model=MODEL, input=inputs, max_output_tokens=4,  # type: ignore[arg-type]
                                       temperature=0)
    newest_first = client.responses.input_items.list(response.id)
    assert [item.content[0].text for item in newest_first.data] == [f"line {n}" for n in (4, 3, 2, 1, 0)]  # type: ignore[union-attr]
    first = client.responses.input_items.list(response.id, order="asc", limit=2)
    assert [item.content[0].text for item in first.data] == ["line 0", "line 1"] and first.has_more  # type: ignore[union-attr]
    rest = client.responses.input_items.list(response.id, order="asc", after=first.data[-1].id)
    assert [item.content[0].text for item in rest.data] == ["line 2", "line 3", "line 4"] and not rest.has_more  # type: ignore[union-attr]
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_" + "0" * 32)


async def test_adding_and_deleting_items_are_requests_of_the_keys_rate_limit(
        base_url: str, make_caller) -> None:  # type: ignore[no-untyped-def]
    limited: Caller = make_caller(org=f"org-item-writes-{SESSION}", limits=Limits(requests_per_minute=3))
    async with httpx.AsyncClient(base_url=base_url, headers={"authorization": f"Bearer {limited.secret}"},
                                 timeout=60) as http:
        created = await http.post("/conversations", json={})
        conversation_id = created.json()["id"]
        added = await http.post(f"/conversations/{conversation_id}/items",
                                json={"items": [{"role": "user", "content": "hi"}]})
        assert added.status_code == 200, added.text
        item_id = added.json()["data"][0]["id"]
        assert (await http.delete(f"/conversations/{conversation_id}/items/{item_id}")).status_code == 200
        refused = await http.post(f"/conversations/{conversation_id}/items",
                                  json={"items": [{"role": "user", "content": "again"}]})
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limit_exceeded"
        assert "retry-after" in refused.headers


async def test_bad_item_writes_get_openai_errors(base_url: str, caller: Caller) -> None:
    async with httpx.AsyncClient(base_url=base_url, headers={"authorization": f"Bearer {caller.secret}"},
                                 timeout=60) as http:
        conversation_id = (await http.post("/conversations", json={})).json()["id"]
        cases = [
            ({"items": []}, "items", "invalid_value"),
            ({"items": [{"role": "user", "content": "x"}] * 21}, "items", "invalid_value"),
            ({"items": [{"role": "user", "content": "x" * 40_000}]}, "items[0].content", "string_above_max_length"),
            ({"items": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "items[0].type",
             "unsupported_parameter"),
        ]
        for body, param, code in cases:
            answer = await http.post(f"/conversations/{conversation_id}/items", json=body)
            assert answer.status_code == 400, (body, answer.text)
            assert (answer.json()["error"]["param"], answer.json()["error"]["code"]) == (param, code), answer.text
        gone = await http.post(f"/conversations/conv_{'0' * 32}/items", json={"items": [{"role": "user",
                                                                                       "content": "x"}]})
        assert gone.status_code == 404
        listed = await http.get(f"/conversations/{conversation_id}/items")
        assert listed.json()["data"] == []  # nothing of the refused writes was kept
