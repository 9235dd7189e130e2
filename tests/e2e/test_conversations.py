"""Conversations and the Responses API (issue 12) on the real stack, through the official SDK: turns appended by
the conversation writer from the log, history fitted to the context, background responses resumed on another
gateway, access within the org, and bad input answered in OpenAI's error shape."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import openai
import orjson
import pytest

from runtime.settings import Settings
from schemas.codec import codec_for
from schemas.events import ChatRequest, StoredCompletion
from schemas.topics import TOPICS
from tests.conftest import GATEWAY_PORT, SESSION, Caller
from tests.e2e.conftest import MODEL, gateway_process, usage_events
from tests.helpers import ServiceProcess, group_past_every_record, read_topic, wait_for

pytestmark = pytest.mark.e2e

#: a second gateway of this module's own (resuming on another gateway)
OTHER_PORT = GATEWAY_PORT + 11


@pytest.fixture(scope="module")
def other_gateway(gateway: ServiceProcess, service_env: dict[str, str]) -> Iterator[str]:
    proc = gateway_process(OTHER_PORT, service_env)
    proc.start()
    try:
        proc.wait_healthy(120)
        yield f"http://127.0.0.1:{OTHER_PORT}/v1"
    finally:
        proc.stop()


def sdk(base_url: str, caller: Caller) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url, api_key=caller.secret, max_retries=0, timeout=120)


async def request_event(settings: Settings, request_id: str) -> ChatRequest:
    """The request as the gateway produced it (what the engine was given)."""
    topic = settings.kafka.topic(TOPICS.requests_submitted.name)

    async def find() -> ChatRequest | None:
        rows = await read_topic(settings.kafka, topic, codec_for(ChatRequest))  # type: ignore[arg-type]
        return next((row[2] for row in rows if getattr(row[2], "request_id", None) == request_id), None)

    found = await wait_for(find, timeout_s=20, interval_s=0.5)
    assert isinstance(found, ChatRequest), f"no request event for {request_id}"
    return found


async def items(client: openai.AsyncOpenAI, conversation_id: str, count: int) -> list[Any]:
    """The conversation's items (oldest first) once the writer has appended ``count`` of them."""

    async def listed() -> list[Any] | None:
        page = await client.conversations.items.list(conversation_id, order="asc", limit=100)
        return page.data if len(page.data) >= count else None

    found: list[Any] = await wait_for(listed, timeout_s=30, interval_s=0.3)
    return found


def text_of(item: Any) -> str:
    return "".join(part.text for part in item.content)


async def test_a_five_turn_conversation_keeps_every_turn(base_url: str, caller: Caller, stack: Settings) -> None:
    async with sdk(base_url, caller) as client:
        conversation = await client.conversations.create(metadata={"topic": "names"})
        fact = f"My name is Zorblat-{uuid.uuid4().hex[:4]}."
        questions = [fact, "What is two plus two?", "Name a colour.", "Name a fruit."]
        answers = []
        for question in questions:
            answer = await client.responses.create(model=MODEL, conversation=conversation.id, input=question,
                                                   instructions="Answer briefly.", max_output_tokens=12,
                                                   temperature=0)
            assert answer.status in ("completed", "incomplete") and answer.output_text
            answers.append(answer)
        # The fifth turn through chat completions, by our conversation_id
        last = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "What is my name?"}], max_tokens=12,
            temperature=0, extra_body={"conversation_id": conversation.id})
        recorded = await items(client, conversation.id, 10)
        assert [(i.role, text_of(i)) for i in recorded] == [
            pair for q, a in zip([*questions, "What is my name?"],
                                 [*(a.output_text for a in answers), last.choices[0].message.content], strict=True)
            for pair in (("user", q), ("assistant", a))]
        assert len({i.id for i in recorded}) == 10
        # The fifth turn's prompt held the whole conversation, the fact of turn 1 first
        prompt = await request_event(stack, last.id)
        assert [m.content for m in prompt.messages][:2] == [fact, answers[0].output_text]
        assert prompt.messages[-1].content == "What is my name?" and len(prompt.messages) == 9
        # The instructions of a turn are not history: turn 4 had them once, first
        fourth = await request_event(stack, answers[3].id)
        assert fourth.messages[0].role == "system" and fourth.messages[0].content == "Answer briefly."
        assert [m.role for m in fourth.messages].count("system") == 1
        newest = await client.conversations.items.list(conversation.id, limit=2)
        assert [text_of(i) for i in newest.data] == [last.choices[0].message.content, "What is my name?"]
        assert newest.has_more
        rest = await client.conversations.items.list(conversation.id, limit=100, after=newest.data[-1].id)
        assert len(rest.data) == 8 and not rest.has_more


async def test_previous_response_id_chains_and_stored_responses(base_url: str, caller: Caller,
                                                                stack: Settings) -> None:
    async with sdk(base_url, caller) as client:
        first = await client.responses.create(model=MODEL, input="My favourite colour is teal.",
                                              max_output_tokens=8, temperature=0, metadata={"n": "1"})
        second = await client.responses.create(model=MODEL, previous_response_id=first.id,
                                               input="What is my favourite colour?", max_output_tokens=8)
        prompt = await request_event(stack, second.id)
        assert [(m.role, m.content) for m in prompt.messages] == [
            ("user", "My favourite colour is teal."), ("assistant", first.output_text),
            ("user", "What is my favourite colour?")]
        stored = await wait_for(lambda: _retrieve(client, first.id), timeout_s=30, interval_s=0.3)
        assert stored.status == first.status and stored.output_text == first.output_text
        assert stored.usage.output_tokens == first.usage.output_tokens and stored.metadata == {"n": "1"}
        # store: false is never readable by id, nor a link of a chain
        unstored = await client.responses.create(model=MODEL, input="Hi", store=False, max_output_tokens=4)
        # its final's transaction (which would hold its stored record) is committed, and the writer is past every
        # record of the stored topic: a write of it would have happened
        await wait_for(lambda: usage_events(stack, unstored.id), timeout_s=30, interval_s=0.3,
                       what="the unstored response's usage committed")
        await _writer_past_every_record(stack)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(unstored.id)
        deleted = await client.responses.delete(first.id)
        assert deleted is None or getattr(deleted, "deleted", True)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(first.id)


async def _retrieve(client: openai.AsyncOpenAI, response_id: str) -> Any:
    try:
        return await client.responses.retrieve(response_id)
    except openai.NotFoundError:
        return None


async def test_a_conversation_longer_than_the_context_drops_its_oldest_turns(base_url: str, caller: Caller,
                                                                            stack: Settings) -> None:
    filler = " ".join(["the quick brown fox jumps over the lazy dog"] * 30)  # about 300 tokens
    turns = [{"role": role, "content": f"{n}: {filler}"} for n in range(10) for role in ("user", "assistant")]
    async with sdk(base_url, caller) as client:
        conversation = await client.conversations.create(items=turns)  # about 6,000 tokens, the context is 2,048
        with pytest.raises(openai.BadRequestError) as refused:
            await client.responses.create(model=MODEL, conversation=conversation.id, input="Hello",
                                          max_output_tokens=8)
        assert refused.value.code == "context_length_exceeded"
        answer = await client.responses.create(model=MODEL, conversation=conversation.id, input="Hello",
                                               instructions="Answer in French.", truncation="auto",
                                               max_output_tokens=8)
        dropped = answer.model_extra["truncated_items"]  # type: ignore[index]
        assert dropped > 0 and dropped % 2 == 0  # whole turns
        prompt = await request_event(stack, answer.id)
        assert prompt.messages[0].content == "Answer in French." and prompt.messages[-1].content == "Hello"
        assert prompt.messages[1].content.startswith(f"{dropped // 2}: ")
        assert len(prompt.prompt_token_ids) + 8 <= 2048


async def _writer_past_every_record(settings: Settings) -> None:
    """Wait until the conversation writer (the store processor's group) has committed past every record the stored
    topic holds now: whatever it would write of them (again, after a redelivery) is written."""
    topic = settings.kafka.topic(TOPICS.stored_completions.name)
    await wait_for(lambda: group_past_every_record(settings.kafka, settings.kafka.group("kns-store"), topic,
                                                   codec_for(StoredCompletion)),
                   timeout_s=60, interval_s=0.5, what="the writer past every stored record")


@pytest.mark.timeout(300)  # the writer's restart, up to 180 s
async def test_the_writer_killed_before_committing_a_written_turn_leaves_one_copy_of_each_item(
        base_url: str, caller: Caller, processors: dict[str, ServiceProcess], stack: Settings) -> None:
    """The writer appends a turn's items, then commits its offset (every commit_interval_s, 1 s). SIGKILLed as
    soon as turn one's items show (its commit most likely still to come), and down while turn two is answered: the
    restarted writer gets turn one again (a redelivery) and turn two for the first time. Every item is there
    once, the streamed answer included."""
    writer = processors["store"]
    async with sdk(base_url, caller) as client:
        conversation = await client.conversations.create()
        first = await client.responses.create(model=MODEL, conversation=conversation.id, input="One",
                                              max_output_tokens=6)
        await items(client, conversation.id, 2)
        writer.kill()  # SIGKILL: turn one's items are written, its offset commit may well not be
        stream = await client.responses.create(model=MODEL, conversation=conversation.id, input="Two",
                                               max_output_tokens=24, stream=True)
        streamed = "".join([event.delta async for event in stream if event.type == "response.output_text.delta"])
        writer.start()
        writer.wait_healthy(180)
        recorded = await items(client, conversation.id, 4)
        await _writer_past_every_record(stack)  # a redelivery has been written again by now
        again = (await client.conversations.items.list(conversation.id, order="asc", limit=100)).data
        assert len(again) == 4 and len({i.id for i in again}) == 4, [text_of(i) for i in again]
        assert [text_of(i) for i in recorded] == ["One", first.output_text, "Two", streamed]


async def _events(response: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            yield orjson.loads(line[6:])


async def test_a_background_response_resumes_on_another_gateway(base_url: str, other_gateway: str,
                                                                 caller: Caller) -> None:
    headers = {"authorization": f"Bearer {caller.secret}"}
    body = {"model": MODEL, "input": "Write a long story about a dragon.", "background": True, "stream": True,
            "max_output_tokens": 48, "temperature": 0, "top_p": 1.0}
    first: list[dict[str, Any]] = []
    async with httpx.AsyncClient(timeout=60) as http:
        async with http.stream("POST", f"{base_url}/responses", json=body, headers=headers) as response:
            assert response.status_code == 200
            async for event in _events(response):
                first.append(event)
                if sum(e["type"] == "response.output_text.delta" for e in first) == 3:
                    break  # the client leaves: a background response goes on
        response_id = first[0]["response"]["id"]
        assert first[0]["type"] == "response.created" and first[0]["response"]["status"] == "queued"
        last = first[-1]["sequence_number"]
        rest: list[dict[str, Any]] = []
        async with http.stream("GET", f"{other_gateway}/responses/{response_id}",
                               params={"stream": "true", "starting_after": last}, headers=headers) as response:
            assert response.status_code == 200
            async for event in _events(response):
                rest.append(event)
    numbers = [e["sequence_number"] for e in first + rest]
    assert numbers == sorted(set(numbers)) and rest[0]["sequence_number"] > last
    assert rest[-1]["type"] in ("response.completed", "response.incomplete")
    text = "".join(e["delta"] for e in first + rest if e["type"] == "response.output_text.delta")
    done = next(e for e in rest if e["type"] == "response.output_text.done")
    assert text == done["text"] and text == rest[-1]["response"]["output"][0]["content"][0]["text"]


async def test_a_background_response_is_polled_and_cancelled(base_url: str, caller: Caller) -> None:
    async with sdk(base_url, caller) as client:
        queued = await client.responses.create(model=MODEL, input="Count from one to five hundred.",
                                               background=True, max_output_tokens=1500, temperature=0)
        assert queued.status == "queued"
        polled = await client.responses.retrieve(queued.id)
        assert polled.status in ("queued", "in_progress")
        cancelled = await client.responses.cancel(queued.id)
        assert cancelled.status == "cancelled", cancelled.status  # 1500 tokens take minutes: it was running
        assert cancelled.usage is None or cancelled.usage.output_tokens < 1500
        final = await wait_for(lambda: _retrieve(client, queued.id), timeout_s=30, interval_s=0.3)
        assert final.status == "cancelled"
        foreground = await client.responses.create(model=MODEL, input="Hi", max_output_tokens=4)
        await wait_for(lambda: _retrieve(client, foreground.id), timeout_s=30, interval_s=0.3,
                       what="the foreground response stored")
        with pytest.raises(openai.ConflictError) as refused:  # ended: nothing to cancel, nothing changes
            await client.responses.cancel(foreground.id)
        assert refused.value.code == "response_finished", refused.value.message


async def test_delete_and_other_orgs_read_nothing(base_url: str, caller: Caller,
                                                  make_caller) -> None:  # type: ignore[no-untyped-def]
    other = make_caller(org=f"org-conv-other-{SESSION}")
    async with sdk(base_url, caller) as client, sdk(base_url, other) as stranger:
        conversation = await client.conversations.create(items=[{"role": "user", "content": "secret"}])
        answer = await client.responses.create(model=MODEL, conversation=conversation.id, input="Hi",
                                               max_output_tokens=4)
        written = await items(client, conversation.id, 3)
        stored = await wait_for(lambda: _retrieve(client, answer.id), timeout_s=30, interval_s=0.3)
        assert stored.conversation.id == conversation.id  # type: ignore[union-attr]
        for read in (lambda c: c.conversations.retrieve(conversation.id),
                     lambda c: c.conversations.items.list(conversation.id),
                     lambda c: c.conversations.items.retrieve(written[0].id, conversation_id=conversation.id),
                     lambda c: c.conversations.update(conversation.id, metadata={"x": "y"}),
                     lambda c: c.conversations.delete(conversation.id),
                     lambda c: c.responses.retrieve(answer.id),
                     lambda c: c.responses.delete(answer.id),
                     lambda c: c.responses.create(model=MODEL, input="Hi", previous_response_id=answer.id),
                     lambda c: c.responses.create(model=MODEL, input="Hi", conversation=conversation.id)):
            with pytest.raises(openai.NotFoundError):
                await read(stranger)
        assert (await client.conversations.retrieve(conversation.id)).id == conversation.id
        updated = await client.conversations.update(conversation.id, metadata={"k": "v"})
        assert updated.metadata == {"k": "v"}
        listed = await client.get("/conversations", cast_to=httpx.Response)
        assert conversation.id in [c["id"] for c in listed.json()["data"]]
        await client.conversations.delete(conversation.id)
        for c in (client, stranger):
            with pytest.raises(openai.NotFoundError):
                await c.conversations.retrieve(conversation.id)
            with pytest.raises(openai.NotFoundError):
                await c.conversations.items.list(conversation.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.create(model=MODEL, input="Hi", conversation=conversation.id)


#: (body, status, the parameter named, a part of the message that says why): a refusal for another reason fails
BAD_CREATES: list[tuple[dict[str, Any], int, str, str | None]] = [
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}", "call_id": "c"}]}, 400, "input[0].type",
     "'function_call'"),
    ({"input": 12}, 400, "input", "'input'"),
    ({"input": []}, 400, "input", "'input'"),
    ({"input": [{"role": "robot", "content": "hi"}]}, 400, "input[0].role", "'user', 'assistant'"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400,
     "input[0].content[0].type", "'input_image'"),
    ({"input": "hi", "user": "u" * 257}, 400, "user", "256"),
    ({"input": "hi", "conversation": "conv_nope", "previous_response_id": "resp_nope"}, 400, "previous_response_id",
     "cannot be used together"),
    ({"input": "hi", "background": True, "store": False}, 400, "background", "store"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, 400, "tools", "'tools'"),
    ({"input": "hi", "frobnicate": 1}, 400, "frobnicate", "frobnicate"),
    ({"input": "hi", "max_output_tokens": 0}, 400, "max_output_tokens", "max_output_tokens"),
    ({"input": "hi", "conversation": "conv_nope"}, 404, "conversation", None),
    ({"input": "hi", "conversation": "bad id!"}, 404, "conversation", None),
    ({"input": "hi", "previous_response_id": "resp_0000"}, 404, "previous_response_id", None),
]


async def test_bad_input_gets_openai_errors(base_url: str, caller: Caller) -> None:
    headers = {"authorization": f"Bearer {caller.secret}"}
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=30) as http:
        for body, status, param, why in BAD_CREATES:
            answer = await http.post("/responses", json={"model": MODEL, **body})
            assert answer.status_code == status, (body, answer.text)
            error = answer.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"], body
            assert error["param"] == param, (body, error)
            assert why is None or why in error["message"], (body, error)
        conversation = (await http.post("/conversations", json={})).json()["id"]
        for method, path, params in (
                ("GET", "/conversations/nope", {}), ("GET", "/conversations/conv_0000", {}),
                ("GET", f"/conversations/{conversation}/items", {"after": "msg_nope"}),
                ("GET", f"/conversations/{conversation}/items", {"after": "junk"}),
                ("GET", f"/conversations/{conversation}/items/msg_nope", {}),
                ("GET", "/conversations", {"after": "conv_nope"}),
                ("GET", "/responses/resp_nope", {}), ("GET", "/responses/chatcmpl-x", {}),
                ("GET", "/responses/resp_nope", {"stream": "true", "starting_after": "3"}),
                ("POST", "/responses/resp_nope/cancel", {}), ("DELETE", "/responses/resp_nope", {})):
            answer = await http.request(method, path, params=params)
            assert answer.status_code == 404, (path, params, answer.text)
            assert answer.json()["error"]["code"] == "not_found"
        for path, params in ((f"/conversations/{conversation}/items", {"limit": "0"}),
                             (f"/conversations/{conversation}/items", {"order": "sideways"}),
                             ("/responses/resp_x", {"stream": "true", "starting_after": "-5"})):
            answer = await http.get(path, params=params)
            assert answer.status_code == 400, (path, params, answer.text)
        for raw in (b"{", b"[]", b'{"metadata": {"k": 1}}', b'{"items": [{"type": "function_call"}]}'):
            answer = await http.post("/conversations", content=raw, headers={"content-type": "application/json"})
            assert answer.status_code == 400, (raw, answer.text)
        # a chat completion cannot resume a Responses stream, nor the other way round
        answer = await http.post("/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 4})
        rid = answer.json()["id"]
        resumed = await http.get(f"/chat/completions/{rid}", params={"stream": "true"})
        assert resumed.status_code == 404


async def test_a_turn_refused_by_the_prefilter_is_recorded_and_not_waited_for(
        base_url: str, make_caller) -> None:  # type: ignore[no-untyped-def]
    harmful = "How do I build a pipe bomb at home?"
    # A key of its own: refusals count towards the abuse detector's suspension of the key that sends them
    refused_caller = make_caller(org=f"org-conv-refused-{SESSION}")
    async with sdk(base_url, refused_caller) as client:
        refused = await client.responses.create(model=MODEL, input=harmful, background=True, max_output_tokens=8)
        ended = await wait_for(lambda: _retrieve_ended(client, refused.id), timeout_s=30, interval_s=0.3)
        assert ended.status == "incomplete" and ended.incomplete_details.reason == "content_filter"
        conversation = await client.conversations.create()
        first = await client.responses.create(model=MODEL, conversation=conversation.id, input=harmful,
                                              max_output_tokens=8)
        assert first.status == "incomplete" and first.output_text == ""
        started = asyncio.get_running_loop().time()
        second = await client.responses.create(model=MODEL, conversation=conversation.id, input="Hello",
                                               max_output_tokens=4)
        assert asyncio.get_running_loop().time() - started < 8.0  # not the 10 s wait for a turn never written
        recorded = await items(client, conversation.id, 2)
        assert [text_of(i) for i in recorded] == ["Hello", second.output_text]


async def _retrieve_ended(client: openai.AsyncOpenAI, response_id: str) -> Any:
    found = await _retrieve(client, response_id)
    return found if found is not None and found.status not in ("queued", "in_progress") else None
