"""The Conversations and Responses APIs after the first review's fixes (pure logic over fakes), from a second
adversarial review of issue 12: each test fails on the reviewed code for the reason in its docstring."""

from __future__ import annotations

import time
from typing import Any

import pytest
from aiokafka import TopicPartition
from redis.exceptions import ConnectionError as RedisConnectionError

import producers.gateway.responses as responses_module
from inference_workers.emitter import Finished
from producers.gateway.errors import ApiError
from producers.gateway.responses import ResponsesService
from producers.gateway.responses_protocol import ResponseCreate
from producers.gateway.service import Accepted, HandedOver
from producers.relay.collector import StreamCollector
from runtime.streams import StreamRecord
from schemas.events import (
    ChatMessage,
    ChatRequest,
    ErrorCode,
    LimitOverrides,
    ReplyTo,
    SamplingSpec,
    StoredCompletion,
    TokenEvent,
    TokenUsage,
    Turn,
    utcnow,
)
from stream_processors.safety.policy import refusal
from stream_processors.store.turns import response_of
from tests.fakes.conversations import (
    Redis,
    Relay,
    Responses,
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
from tests.helpers import wait_for

BACKGROUND = {"model": "m", "input": "hi", "background": True, "max_output_tokens": 16}


def turn_request(request_id: str, *, background: bool = True) -> ChatRequest:
    now = utcnow()
    return ChatRequest(
        request_id=request_id, created_at=now, org_id="org", key_id="k", tier="plus", model="m",
        messages=[ChatMessage(role="user", content="hi")], prompt_token_ids=[1, 2],
        sampling=SamplingSpec(max_tokens=8), stream=False, reply=ReplyTo(partition=0, gateway_id="gw/1"),
        conversation_id="conv_1", turn=Turn(api="responses", input_count=1, background=background))


def limited_service(store: Responses | None = None) -> tuple[ResponsesService, Any, RecordingPublisher]:
    publisher = RecordingPublisher()
    chat = chat_service(publisher, Relay(), admission=local_admission())
    service = ResponsesService(chat, prompts(), planner(), store or Responses(), publisher)  # type: ignore[arg-type]
    return service, chat, publisher


# --- 1. a background response deleted before the hold looks keeps its slot for 15 minutes ---------------------


async def test_a_background_response_deleted_right_after_it_ended_frees_its_slot(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """producers/gateway/responses.py _hold: the held slot is freed only when ``ResponseStore.get`` returns the
    row, and ``get`` answers None for a deleted row. A client that polls GET, sees ``completed`` and DELETEs at
    once (before the hold's next poll, HOLD_POLL_S = 1 s) leaves the hold polling for HOLD_LIMIT_S = 900 s: a key
    with max_concurrent=1 is refused (429) for 15 minutes although nothing of it runs."""
    monkeypatch.setattr(responses_module, "HOLD_POLL_S", 0.01)
    store = Responses()
    service, chat, _ = limited_service(store)
    key = api_key(limits=LimitOverrides(max_concurrent=1))
    body = ResponseCreate.model_validate(BACKGROUND)
    accepted, first = await service.create(body, key, client_addr=None, traceparent="tp")
    service.queued(accepted, first)
    store.rows[first.id] = row(first.id, None, background=True)  # it completed...
    await service.delete(first.id, key)  # ...and its client deleted it at once
    await wait_for(lambda: not service._holding, timeout_s=5, interval_s=0.01, what="the hold let go of the slot")
    await chat.drain()
    try:
        await service.create(body, key, client_addr=None, traceparent="tp")
    finally:
        service.stop()
    # (no 429: the first response's slot is free)


# --- 2. a refused background turn: its successor waits turn_wait_s ---------------------------------------------


async def test_a_turn_does_not_wait_for_a_predecessor_refused_by_the_prefilter() -> None:
    """producers/gateway/turns.py _ended_unanswered vs stream_processors/store/turns.py answered(): a turn refused
    by the safety pre-filter is recorded (end_here) as ``incomplete``/content_filter with no text, which is not
    appended (answered() needs text), but _ended_unanswered counts every ``incomplete`` as answered. A background
    turn so refused never calls ended_unwritten (its create closed "detached"), so the conversation's next turn
    polls for the full turn_wait_s (10 s) for an answer that never comes, although the row says how it ended."""
    refused = turn_request("resp_prev")
    stored = response_of(StoredCompletion.of(refused, "", refusal(refused)))
    assert stored is not None and stored.status == "incomplete" and stored.output_text == ""
    turns = planner(responses=Responses([stored]), redis=Redis(last_turn="resp_prev"), turn_wait_s=1.0)
    started = time.monotonic()
    await turns.plan(ask(conversation_id="conv_1"))
    assert time.monotonic() - started < 0.5


# --- 3. DELETE with the stream registry down answers 404 ---------------------------------------------------------


class DownStreams:
    """A StreamDirectory whose Redis is unreachable."""

    async def lookup(self, request_id: str) -> StreamRecord | None:
        raise RedisConnectionError("Connection refused")

    async def forget(self, request_id: str) -> None:
        raise RedisConnectionError("Connection refused")


async def test_deleting_a_response_while_redis_is_down_is_a_503_not_a_404() -> None:
    """producers/gateway/responses.py delete() → _in_progress(): ``except ApiError: return False`` also swallows
    the 503 that stream_record() raises when Redis is down, so DELETE of a background response still running
    answers ``404 not_found``: the client takes it for gone (or never existing) while it runs, completes and
    becomes readable. GET of the same id answers 503 at the same moment."""
    publisher = RecordingPublisher()
    chat = chat_service(publisher, Relay())
    chat._streams = DownStreams()  # type: ignore[assignment]
    service = ResponsesService(chat, prompts(), planner(), Responses(), publisher)  # type: ignore[arg-type]
    key = api_key()
    with pytest.raises(ApiError) as read:
        await service.get("resp_abc", key)
    assert read.value.status == 503
    with pytest.raises(ApiError) as refused:
        await service.delete("resp_abc", key)
    assert refused.value.status == 503, (refused.value.status, refused.value.code)


# --- 4. a background stream the gateway cannot read is reported failed while it goes on ---------------------------


async def test_a_background_stream_failed_on_the_gateways_side_is_not_reported_failed_while_it_goes_on() -> None:
    """producers/gateway/responses.py stream(): only STREAM_TIMEOUT is treated as "the gateway gave up, not the
    generation". A background stream that this gateway cannot read (UNDECODABLE_EVENT: a newer worker's token
    record during a rolling deploy; or STREAM_INCONSISTENT) sends its client ``response.failed``, while close()
    never cancels a background response: it goes on, completes, and GET then answers ``completed``. (close() also
    frees its slot at once and, for a conversation turn, forgets the Redis note of a turn that will be appended.)"""
    publisher = RecordingPublisher()
    chat = chat_service(publisher, Relay())
    the_view = view(background=True)
    collector = StreamCollector("resp_abc")
    collector.put(token(0, "a"))
    collector.fail("this gateway cannot read a token event of the request", ErrorCode.UNDECODABLE_EVENT)
    accepted = Accepted(None, collector, "tp", False, time.perf_counter(), client_has=-1, record=record(the_view))
    accepted.background = True
    service = ResponsesService(chat, prompts(), planner(), Responses(), publisher)  # type: ignore[arg-type]
    events = parse(b"".join([chunk async for chunk in service.stream(accepted, the_view)]))
    await chat.drain()
    failed = any(e["type"] == "response.failed" for e in events)
    assert not failed or publisher.cancelled, "told failed, yet never cancelled: it goes on and completes"


# --- 5. a handed-over background stream frees its slot while it goes on ----------------------------------------


async def test_a_handed_over_background_stream_keeps_its_slot() -> None:
    """producers/gateway/responses.py stream() finally + service.close(): a background response streaming when its
    gateway stops ends "handed_over", which closes it with its ticket: the in-flight slot is freed at once while
    the generation goes on (a resume elsewhere takes no ticket). Every other path keeps a background response's
    slot until it ends (_hold), or lets it lapse with its lease when the gateway stops; here a key limited to
    max_concurrent=1 starts a second background generation beside the first."""
    service, chat, _ = limited_service()
    key = api_key(limits=LimitOverrides(max_concurrent=1))
    body = ResponseCreate.model_validate({**BACKGROUND, "stream": True})
    accepted, first = await service.create(body, key, client_addr=None, traceparent="tp")
    chat.hand_over()
    with pytest.raises(HandedOver):
        async for _ in service.stream(accepted, first):
            pass
    await chat.drain()
    with pytest.raises(ApiError) as refused:  # the first is still being generated
        await service.create(ResponseCreate.model_validate(BACKGROUND), key, client_addr=None, traceparent="tp")
    assert refused.value.status == 429


# --- 6. a turn whose final cannot be written is never recorded --------------------------------------------------


async def test_a_turn_recorded_without_its_text_still_gets_its_record() -> None:
    """inference_workers/emitter.py Finished.without_text: when a final cannot be written (its size, usually) the
    worker commits it without text and drops ``stored`` ("would refuse the stored copy too"). For a turn that record
    is the only way its end is known: a background response then never gets its row, so its slot is held for
    HOLD_LIMIT_S (900 s), GET answers ``in_progress`` for the 15-minute resume window then 404, a
    previous_response_id naming it answers 400 "still in progress", and the conversation's next turn waits
    turn_wait_s. (The first review named this path; only the pre-filter's was fixed.) A text-less failed record
    would be small."""
    request = turn_request("resp_big")
    final = TokenEvent(request_id="resp_big", attempt=1, seq=3, token_offset=3, token_ids=[7], text="x",
                       finish_reason="stop", usage=TokenUsage(prompt_tokens=2, completion_tokens=4), worker_id="w",
                       emitted_at_us=1)
    item = Finished(final, None, 0, TopicPartition("t", 0), 0, None, None,
                    stored=StoredCompletion.of(request, "a very long answer", final))
    kept = item.without_text("the final event could not be written: MessageSizeTooLargeError")
    assert kept.stored is not None, "the turn is never recorded: its response row never appears"
    stored = response_of(kept.stored)
    assert stored is not None and stored.status == "failed"


# --- 7. a background create whose stream record was not written cannot be cancelled --------------------------------


class LostRecordStreams:
    """A StreamDirectory whose write failed (Redis away for a moment) and that answers again afterwards."""

    async def record(self, record: StreamRecord) -> None:
        raise RedisConnectionError("Connection reset by peer")

    async def lookup(self, request_id: str) -> StreamRecord | None:
        return None


async def test_a_queued_background_response_can_be_cancelled(monkeypatch: pytest.MonkeyPatch) -> None:
    """producers/gateway/service.py _record_stream(): a stream record that cannot be written is only logged ("only
    a resume elsewhere will not find it"). For a background response the record is its only handle while it
    runs: create answers 200 ``queued``, then GET, POST /cancel and DELETE all answer 404 until its row is written
    (up to its whole generation): the client cannot cancel a generation it is billed for. Either the create
    should be refused (503), or cancel should still reach it."""
    monkeypatch.setattr(responses_module, "CANCEL_WAIT_S", 0.2)
    publisher = RecordingPublisher()
    chat = chat_service(publisher, Relay())
    chat._streams = LostRecordStreams()  # type: ignore[assignment]
    service = ResponsesService(chat, prompts(), planner(), Responses(), publisher)  # type: ignore[arg-type]
    key = api_key()
    try:
        accepted, created = await service.create(ResponseCreate.model_validate(BACKGROUND), key, client_addr=None,
                                                 traceparent="tp")
    except ApiError as exc:
        assert exc.status == 503
        return
    service.queued(accepted, created)
    try:
        await service.cancel(created.id, key, traceparent="tp")
    except ApiError as exc:
        assert exc.status != 404, "accepted as queued, then unknown to its own cancel"
    finally:
        service.stop()
