"""The Conversations and Responses APIs under faults and adversarial input (pure logic over fakes), from an
adversarial review of issue 12: each test fails on the reviewed code for the reason in its docstring."""

from __future__ import annotations

import inspect
import time
from functools import partial
from typing import Any

import orjson
import pytest

import stream_processors.safety.processor as safety_processor
from producers.gateway.app import _responding
from producers.gateway.errors import ApiError
from producers.gateway.responses import ResponsesService, stored_body
from producers.gateway.responses_protocol import ResponseCreate, ResponseView
from producers.gateway.service import Accepted
from producers.relay.collector import StreamCollector
from schemas.events import (
    ChatMessage,
    ChatRequest,
    LimitOverrides,
    ReplyTo,
    SamplingSpec,
    StoredCompletion,
    TokenEvent,
    TokenUsage,
    Turn,
    utcnow,
)
from stream_processors.store.conversations import Item
from stream_processors.store.turns import response_of
from tests.fakes.conversations import (
    NOW,
    Conversations,
    Redis,
    Relay,
    Responses,
    Streams,
    ask,
    parse,
    planner,
    prompts,
    record,
    row,
    token,
    view,
)
from tests.fakes.gateway import RecordingPublisher, chat_service
from tests.fakes.tenancy import api_key, local_admission


async def timed_out_stream(background: bool, *, starting_after: int = -1
                           ) -> tuple[list[dict[str, Any]], RecordingPublisher]:
    """A Responses stream that got five deltas, then no token within the gateway's idle timeout."""
    publisher = RecordingPublisher()
    chat = chat_service(publisher, Relay(), stream_idle_timeout_s=0.05)
    the_view = view(background=background)
    collector = StreamCollector("resp_abc", skip_through=max(starting_after - 3, 0))
    for seq, text in enumerate(["a", "b", "c", "d", "e"]):
        collector.put(token(seq, text))
    accepted = Accepted(None, collector, "tp", False, time.perf_counter(), client_has=starting_after - 3,
                        record=record(the_view))
    accepted.background = background
    service = ResponsesService(chat, prompts(), planner(), Responses(), publisher)  # type: ignore[arg-type]
    raw = b"".join([chunk async for chunk in service.stream(accepted, the_view, starting_after=starting_after)])
    await chat.drain()
    return parse(raw), publisher


# --- 1. a gateway timeout's response.failed has sequence number 4 ---------------------------------------------


async def test_a_gateway_timeout_numbers_its_failed_event_after_the_deltas() -> None:
    """producers/gateway/responses.py stream(): the gateway's own timeout (ChatService.next_delta) is a Delta with
    the default ``position=0``, and the stream ends with ``fmt.ending(delta.position + 1)``: ``response.failed``
    gets sequence number 4 after deltas numbered up to 8 (non-monotonic, and a duplicate of the first delta's
    number), so a client resuming with ``starting_after`` >= 4 gets no terminal event at all."""
    events, _ = await timed_out_stream(background=False)
    numbers = [e["sequence_number"] for e in events]
    assert events[-1]["type"] == "response.failed"
    assert numbers == sorted(set(numbers)), numbers


async def test_a_resumed_stream_that_times_out_still_ends_with_a_terminal_event() -> None:
    """Same defect, seen by a resumed client: with ``starting_after=6`` the failed event (numbered 4) is taken
    for one the client already has and dropped; the stream closes with no response.failed/completed event."""
    events, _ = await timed_out_stream(background=False, starting_after=6)
    assert events and events[-1]["type"] == "response.failed", [e["type"] for e in events]


# --- 2. a background response told "failed" while it goes on --------------------------------------------------


async def test_a_background_stream_that_times_out_is_not_reported_failed_while_it_goes_on() -> None:
    """producers/gateway/responses.py stream() + service.close(): when the gateway gives up waiting on a background
    response's stream (idle timeout), the client is sent a terminal ``response.failed`` (status failed), yet
    close() never cancels a background response: it goes on, later completes, and GET answers ``completed``.
    (close() also calls turns.ended_unwritten, so the next conversation turn does not wait for a turn that will
    be appended.) A background stream whose gateway gives up should end like a handover, not as a failure."""
    events, publisher = await timed_out_stream(background=True)
    assert publisher.cancelled == []  # the generation goes on...
    assert not any(e["type"] == "response.failed" for e in events)  # ...so it must not be reported failed


# --- 3. previous_response_id naming a store=false response --------------------------------------------------


async def test_a_previous_response_that_is_not_stored_is_not_found_at_once() -> None:
    """producers/gateway/app.py _responding / turns.py _previous: a ``store: false`` response never gets a row,
    but its stream record lives for the 15-minute resume window and ``_responding`` takes any record with extra
    for "in flight". A turn naming it as previous_response_id polls for turn_wait_s and then answers
    ``400 previous_response_in_progress`` ("retry once it has completed"): for 15 minutes, even after it
    completed; a retry never helps. It is unreadable by id, so the answer should be 404 at once."""
    streams = Streams(record(view(store=False)))
    turns = planner(in_flight=partial(_responding, streams), turn_wait_s=0.3)
    with pytest.raises(ApiError) as refused:
        await turns.plan(ask(previous_response_id="resp_abc"))
    assert refused.value.status == 404, (refused.value.status, refused.value.code)


# --- 4. the previous_response_id chain is unbounded over failed links ---------------------------------------


async def test_a_chain_of_failed_responses_is_read_within_the_history_bound() -> None:
    """producers/gateway/turns.py _chain: the loop stops at ``count < history_bound`` but only answered turns
    add to ``count``; a chain of failed or cancelled responses (cheap to make: cancel background responses) is
    walked to its very first link, one sequential Cassandra read per link, however long it is."""
    rows = [row("resp_0", None, status="cancelled")]
    rows += [row(f"resp_{i}", f"resp_{i - 1}", status="cancelled") for i in range(1, 500)]
    store = Responses(rows)
    turns = planner(responses=store, max_model_len=30)  # history_bound: 10
    await turns.plan(ask(previous_response_id="resp_499"))
    assert store.reads <= turns.history_bound + 1, store.reads


# --- 5. a conversation turn after a failed background turn waits turn_wait_s ------------------------------------


async def test_a_turn_does_not_wait_for_a_predecessor_that_ended_failed() -> None:
    """producers/gateway/turns.py _await_previous_turn: the Redis note of a background turn is never forgotten
    (its create closes "detached", which counts as appended; POST /cancel and a worker failure never call
    ended_unwritten). When it ends failed or cancelled its answer item never comes, so the conversation's next
    turn polls Cassandra for the full turn_wait_s (10 s) although the predecessor's stored response row already
    says how it ended."""
    redis = Redis(last_turn="resp_prev")
    store = Responses([row("resp_prev", None, status="failed", background=True)])
    turns = planner(responses=store, redis=redis, turn_wait_s=1.0)
    started = time.monotonic()
    await turns.plan(ask(conversation_id="conv_1"))
    assert time.monotonic() - started < 0.5


# --- 6. DELETE of a response in progress is a 404 while GET finds it ------------------------------------------


async def test_a_response_in_progress_can_be_deleted() -> None:
    """producers/gateway/responses.py delete(): it only marks a stored row, and the row is written at the end.
    DELETE of a (background) response still being generated answered 404 right after GET answered it, and the
    response then completed and became readable: the client's delete was lost. Now: 409 response_in_progress
    (cancel it, or wait for its end), never a 404 for what GET just showed."""
    publisher = RecordingPublisher()
    chat = chat_service(publisher, Relay())
    chat._streams = Streams(record(view(background=True)))  # type: ignore[assignment]
    service = ResponsesService(chat, prompts(), planner(), Responses(), publisher)  # type: ignore[arg-type]
    key = api_key()
    assert (await service.get("resp_abc", key))["status"] == "in_progress"
    with pytest.raises(ApiError) as refused:
        await service.delete("resp_abc", key)
    assert refused.value.status == 409 and refused.value.code == "response_in_progress"


# --- 7. a stored response forgets its sampling -----------------------------------------------------------------


def test_a_stored_response_keeps_its_temperature_and_top_p() -> None:
    """schemas/events.py Turn + stream_processors/store/turns.py response_of: neither the Turn nor the
    StoredCompletion carries the request's sampling, so StoredResponse.temperature/top_p are always the defaults:
    a response created with temperature 0.2, top_p 0.5 reads back (GET /v1/responses/{id}) as 1.0/1.0. (Likewise
    ``truncation: "auto"`` reads back "disabled" when nothing was dropped, and completed_at is never recorded.)"""
    now = utcnow()
    request = ChatRequest(
        request_id="resp_abc", created_at=now, org_id="org", key_id="k", tier="plus", model="m",
        messages=[ChatMessage(role="user", content="hi")], prompt_token_ids=[1, 2],
        sampling=SamplingSpec(max_tokens=8, temperature=0.2, top_p=0.5), stream=False,
        reply=ReplyTo(partition=0, gateway_id="gw/1"), turn=Turn(api="responses", input_count=1))
    final = TokenEvent(request_id="resp_abc", attempt=1, seq=1, token_offset=1, token_ids=[], text="",
                       finish_reason="stop", usage=TokenUsage(prompt_tokens=2, completion_tokens=1), worker_id="w",
                       emitted_at_us=1)
    stored = response_of(StoredCompletion.of(request, "hello", final))
    assert stored is not None
    body = stored_body(stored)
    assert (body["temperature"], body["top_p"]) == (0.2, 0.5)


# --- 8. a stream record written by a newer gateway ------------------------------------------------------------


def test_a_response_view_from_a_newer_gateway_still_reads() -> None:
    """producers/gateway/responses_protocol.py ResponseView.from_json: ``cls(**orjson.loads(text))`` raises
    TypeError on any field it does not know. During a rolling deploy, a stream record written by a newer gateway
    (one more field in its extra) makes GET /v1/responses/{id}, its resume and its cancel answer 500 on an older
    one, for the 15-minute resume window. The Avro events are versioned for exactly this; this JSON is not."""
    text = orjson.dumps({**orjson.loads(view().to_json()), "reasoning_effort": "low"}).decode()
    assert ResponseView.from_json(text).id == "resp_abc"


# --- 9. a response refused or expired by the safety pre-filter never gets its row ---------------------------


def test_the_safety_prefilter_records_the_turns_it_ends() -> None:
    """stream_processors/safety/processor.py screen(): a request refused by the pre-filter (or expired there) is
    ended with a final token event only; the worker never sees it, so no StoredCompletion is written (the topic's
    only producer is the worker). README: a refused turn's "response row records how it ended" — it gets none. A
    background response so refused answers GET ``queued`` for the 15-minute resume window, then 404; its cancel
    waits 5 s; a previous_response_id naming it waits turn_wait_s then answers 400 "still in progress"; the
    conversation's next turn waits turn_wait_s. (Same for the worker's undecodable and ``without_text`` ends.)"""
    source = inspect.getsource(safety_processor.build)
    assert "stored_completions" in source


# --- 10. background responses bypass max_concurrent -----------------------------------------------------------


async def test_background_responses_count_against_max_concurrent() -> None:
    """producers/gateway/responses.py queued(): a background create closes its Accepted at once, which frees its
    admission slot, so ``max_concurrent`` never counts background generations: a key limited to 1 concurrent
    request runs as many background generations at once as its request and token rates allow (README calls
    this a design choice, but "Turns are admitted, limited and billed like any request" does not hold)."""
    publisher = RecordingPublisher()
    chat = chat_service(publisher, Relay(), admission=local_admission())
    service = ResponsesService(chat, prompts(), planner(), Responses(), publisher)  # type: ignore[arg-type]
    key = api_key(limits=LimitOverrides(max_concurrent=1))
    body = ResponseCreate.model_validate({"model": "m", "input": "hi", "background": True,
                                          "max_output_tokens": 16})
    accepted, first = await service.create(body, key, client_addr=None, traceparent="tp")
    service.queued(accepted, first)
    await chat.drain()
    with pytest.raises(ApiError) as refused:  # the first is still being generated
        await service.create(body, key, client_addr=None, traceparent="tp")
    assert refused.value.status == 429


# --- 11. developer items of a conversation replay as role "developer" --------------------------------------------


async def test_a_conversations_developer_item_replays_as_system() -> None:
    """producers/gateway/conversations.py create() stores initial items with ``m.role`` ("developer" kept), and
    turns.py _message replays an item's role as is; a turn's own input maps developer to system
    (InputMessage.as_event: "the chat template knows system"). So a conversation created with a developer item
    renders ``<|im_start|>developer`` into every later prompt of the conversation (or fails on templates that
    check roles), unlike the same message sent as input."""
    history = [Item("msg_c_0", "developer", "Answer in French.", NOW, 0)]
    planned = await planner(conversations=Conversations(history)).plan(ask(conversation_id="conv_1"))
    assert [m.role for m in planned.messages] == ["system", "user"]
