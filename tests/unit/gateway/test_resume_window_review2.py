"""Second adversarial review of the resume window and of what came with it, the gateway's side: read-your-writes
(3843225), a client back on the same gateway taking its stream over (3da0641) and refusals remembered before the
expensive work (bc4b255, dccd9f7). Each test states a defect the review found, its consequence for a user or a bill,
and the code line (as of 45363b0); each failed on 45363b0 for the reason it names and passes since its fix."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from producers.gateway.admission import LimitRefusal
from producers.gateway.early import EarlyRefusals
from producers.gateway.errors import ApiError
from producers.gateway.local_limiter import LocalLimiter
from producers.gateway.protocol import ChatCompletionRequest
from producers.gateway.service import ChatService
from runtime.limiter import Refused, Window
from runtime.settings import GatewaySettings, TenancySettings, TierTable
from schemas.events import (
    ORIGIN_ATTACHMENT,
    ChatMessage,
    LimitOverrides,
    SamplingSpec,
    TokenEvent,
    TokenUsage,
    Turn,
)
from stream_processors.safety.policy import refusal
from tests.fakes.gateway import PROMPTS, Clock, RecordingPublisher, Relay, Streams
from tests.fakes.tenancy import api_key, local_admission


class Pending:
    """``PendingWrites.note``'s seam: the read-your-writes notes the gateway writes."""

    def __init__(self) -> None:
        self.notes: list[tuple[str, bool, str | None]] = []

    async def note(self, request_id: str, org_id: str, *, stored: bool, conversation_id: str | None) -> None:
        self.notes.append((request_id, stored, conversation_id))


def service() -> tuple[ChatService, RecordingPublisher, Relay, Pending]:
    publisher, relay, pending = RecordingPublisher(), Relay(), Pending()
    chat = ChatService(GatewaySettings(instance_id="gw"), PROMPTS, publisher, relay, 0, "gw/1",  # type: ignore[arg-type]
                       admission=local_admission(), tiers=TenancySettings().tiers.policies(), streams=Streams(),  # type: ignore[arg-type]
                       pending=pending)  # type: ignore[arg-type]
    return chat, publisher, relay, pending


def final(request_id: str, seq: int, finish_reason: str = "stop") -> TokenEvent:
    return TokenEvent(request_id=request_id, attempt=1, seq=seq, token_offset=seq, token_ids=[], text="",
                      finish_reason=finish_reason, usage=TokenUsage(prompt_tokens=3, completion_tokens=seq),
                      worker_id="w", emitted_at_us=seq)


def delta(request_id: str, seq: int) -> TokenEvent:
    return TokenEvent(request_id=request_id, attempt=1, seq=seq, token_offset=seq, token_ids=[seq], text=f" t{seq}",
                      worker_id="w", emitted_at_us=seq)


# --- read-your-writes ---------------------------------------------------------------------------------------------


async def test_a_stored_response_that_ended_is_noted_for_its_reads_to_wait_for_its_row() -> None:
    """Defect: ``_note_pending_write`` (service.py:477) decides "the writer stores a row" from ``request.store``, the
    chat completions' ``store``; a Responses API request carries its ``store`` in ``request.turn.store``
    (``ResponsesService._create`` builds the request without ``store``, responses.py:95-98, and its stream record
    says ``store=False`` too, service.py:311), so a stored response outside a conversation is never noted (inside one,
    only its conversation is). Consequence: ``responses.retrieve`` right after ``responses.create`` returned (the
    OpenAI SDK's create-then-retrieve; ``store`` defaults to true) finds no note, does not wait, and answers the stream
    record's ``status: "in_progress"`` with no output (responses.py:228) until the writer catches up: the
    read-your-writes 3843225 promises for responses.retrieve does not hold (its e2e test passes only through the
    conversation's note and the writer's order). Fix: ``stored = request.store or (request.turn is not None and
    request.turn.api == "responses" and request.turn.store)``, and the stream record's ``store`` likewise."""
    chat, _publisher, relay, pending = service()
    key = api_key()
    request = chat.new_request("resp_0123", key, "m", [ChatMessage(role="user", content="hi")], [1, 2, 3],
                               SamplingSpec(max_tokens=8), stream=False,
                               turn=Turn(api="responses", input_count=1, store=True))
    accepted = await chat.submit(request, key, traceparent="00-0-0-01", received_at=0.0, extra='{"id":"resp_0123"}')
    relay.collectors[request.request_id].put(final(request.request_id, 0))
    ended = await chat.next_delta(accepted)
    chat.close(accepted, "stop", stream=False)
    await chat.drain()
    assert ended.finished
    assert pending.notes == [(request.request_id, True, None)]


async def test_a_stored_completion_refused_by_the_pre_filter_leaves_no_note_its_reads_would_wait_for() -> None:
    """Defect: ``_note_pending_write`` (service.py:482-484) notes ``pending:<id>`` for every final of a ``store: true``
    completion; the safety pre-filter's refusal is such a final (``policy.refusal``: content_filter, no usage, by
    ``safety-prefilter``), but since cf1c9c2 the pre-filter writes no stored completion for it
    (``end_here(..., stored=False)``). Consequence: for the note's TTL (60 s) every GET, GET .../messages and DELETE
    of that id waits ``read_wait_s`` (5 s) polling Cassandra every 50 ms (``PendingWrites._until``, 100 reads) before
    its 404; GET by id takes no read admission (routes/chat.py:245), so one refused request (free: refusals are not
    billed) lets its key make each GET cost 100 Cassandra reads and a gateway coroutine for 5 s. Fix: no stored note
    for a final no worker generated (the pre-filter's ``worker_id``, or content_filter with no prompt tokens billed),
    or let the pre-filter's refusal say the row is not written."""
    chat, _publisher, relay, pending = service()
    body = ChatCompletionRequest.model_validate({"model": "m", "stream": True, "store": True,
                                                 "messages": [{"role": "user", "content": "something refused"}]})
    accepted = await chat.accept(body, api_key(), client_addr=None, traceparent="00-0-0-01")
    assert accepted.request is not None
    relay.collectors[accepted.request_id].put(refusal(accepted.request))
    body_bytes = [chunk async for chunk in chat.stream(accepted)]
    await chat.drain()
    assert any(b"content_filter" in chunk for chunk in body_bytes)
    assert [note for note in pending.notes if note[1]] == []


# --- a client back on the same gateway ------------------------------------------------------------------------------


async def test_a_connection_taken_over_on_the_same_gateway_is_detached_at_once_whatever_its_task_does() -> None:
    """Defect: ``_supersede`` (service.py:373) only fails the old connection's collector; its DETACH is produced by
    the old task's ``close`` (service.py:595), when that task next runs. The case supersede exists for, a client
    whose network changed address without a FIN, is also the one where the old task may not run for minutes: its
    response is blocked writing to a socket nobody reads (uvicorn awaits the transport's drain once its buffer is
    full) until TCP gives up. Consequence: meanwhile the worker counts the old connection attached (its gateway is
    alive): if the new connection drops too, the generation is neither suspended nor its window started; it is
    generated to its end for nobody and billed whole (``received_cap`` is None while a connection is live). Fix:
    produce the old attachment's DETACH (with what it delivered) in ``_supersede`` itself, and let the old task's
    close skip it."""
    chat, publisher, relay, _pending = service()
    body = ChatCompletionRequest.model_validate({"model": "m", "stream": True,
                                                 "messages": [{"role": "user", "content": "hi"}]})
    accepted = await chat.accept(body, api_key(), client_addr=None, traceparent="00-0-0-01")
    collector = relay.collectors[accepted.request_id]
    old = chat.stream(accepted)
    try:
        collector.put(delta(accepted.request_id, 0))
        await old.__anext__()  # the role chunk
        await old.__anext__()  # then its task blocks writing to a dead socket: it does not iterate again
        resumed = await chat.resume(accepted.request_id, 0, api_key(), traceparent="00-0-0-01")
        await chat.drain()
        assert [a.attachment for a in publisher.attaches] == [resumed.attachment]
        assert [(d.attachment, d.delivered_tokens) for d in publisher.detaches] == [(ORIGIN_ATTACHMENT, 1)]
    finally:
        with contextlib.suppress(Exception):
            await old.aclose()  # type: ignore[attr-defined]
        await chat.drain()


# --- refusals remembered ------------------------------------------------------------------------------------------


def rpm_refusal(limit: int) -> LimitRefusal:
    """The limiter's 429 for a key's requests per minute: its bucket (of ``limit``) refills one request in a minute."""
    wait_ms = 60_000 // limit
    window = Window(limit, 0, wait_ms, 10_000, 10_000, 0)
    return LimitRefusal(Refused("requests", "key", wait_ms, limit, window), 429,
                        f"Rate limit reached for API key k on requests per min (RPM): Limit {limit}.", type="requests",
                        code="rate_limit_exceeded", headers={"retry-after": str(wait_ms // 1000),
                                                             "retry-after-ms": str(wait_ms)})


def test_a_key_whose_limits_an_admin_raised_is_not_refused_by_a_refusal_remembered_under_the_old_ones() -> None:
    """Defect: ``EarlyRefusals.check`` (early.py:64) voids a remembered refusal when the org's record changed only
    for budget refusals; an RPM refusal stands for the wait the old limit gave (early.py:80: up to 60 s at 1 RPM).
    The shared limiter refills a bucket at its new limit's rate (runtime/limiter.py, ``levels[i]``: at 1,000 RPM a
    request is back within 60 ms), and 7a90210 promises that a limit change applies on every gateway within a
    second. Consequence: after an admin (or an operator) raises a throttled org's limits, its keys keep getting 429
    on every gateway that remembered a refusal, for up to a minute, with no Redis round trip to notice. Fix: remember
    the org record with every refusal and void it when the key's org is another record (as for budgets)."""
    clock = Clock()
    early = EarlyRefusals(TierTable.model_validate({}), clock=clock)
    throttled = api_key(limits=LimitOverrides(requests_per_minute=1))
    early.remember(throttled, rpm_refusal(1))
    raised = api_key(limits=LimitOverrides(requests_per_minute=1000))  # the org's record after the admin's PATCH
    clock.now += 0.1  # the shared bucket, at 1,000 RPM, holds a request again
    early.check(raised)


class FlakyShared(LocalLimiter):
    """The shared limiter (Redis), down until the test brings it back; its buckets are those of the whole fleet."""

    down = True

    async def admit(self, *args: Any, **kwargs: Any) -> Any:
        if self.down:
            raise RedisConnectionError("Redis is down")
        return await super().admit(*args, **kwargs)


async def test_a_refusal_the_fallback_limiter_made_while_redis_was_down_does_not_outlive_the_outage() -> None:
    """Defect: ``ChatService._admit`` (service.py:273) remembers every requests-per-minute refusal, whichever limiter
    made it; with Redis down a ``local`` tier is admitted by this process's own limiter, whose buckets hold
    ``tenancy.local_share`` of the limits (so its waits are 1/share as long), and ``EarlyRefusals`` cannot tell
    (early.py:76-80). Its premise, "other gateways only take from the bucket", holds for the shared bucket, not for
    a local one the fleet's limiter never saw. Consequence: after a Redis outage, each key the fallback throttled stays
    refused on that gateway for the local wait (here 60 s at 2 RPM and a share of 1/2) although the shared limiter,
    back, would admit it at once. Fix: remember only the shared limiter's refusals (``LimitRefusal`` saying which
    limiter refused, or ``Admission.admit`` returning it)."""
    from producers.gateway.admission import Admission

    shared = FlakyShared()
    admission = Admission(shared, LocalLimiter(share=0.5), TierTable.model_validate({}))
    chat = ChatService(GatewaySettings(instance_id="gw"), PROMPTS, RecordingPublisher(), Relay(), 0, "gw/1",  # type: ignore[arg-type]
                       admission=admission)
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    key = api_key(tier="plus", limits=LimitOverrides(requests_per_minute=2))
    await chat.accept(body, key, client_addr=None, traceparent="00-0-0-01")  # the local bucket holds 1 of 2
    with pytest.raises(ApiError) as local:
        await chat.accept(body, key, client_addr=None, traceparent="00-0-0-01")
    assert local.value.status == 429
    shared.down = False  # Redis is back: the fleet's bucket of 2 is full
    await chat.accept(body, key, client_addr=None, traceparent="00-0-0-01")
    await chat.drain()


async def test_a_stream_taken_over_on_the_same_gateway_keeps_its_local_in_flight_slot() -> None:
    """Defect: the connection a resume supersedes closes as "handed_over" (service.py:500), and ``_end_ticket``
    (service.py:617-620) ends a local limiter's ticket at once for that outcome, which is right for a gateway that stops
    (its limiter goes with it) but not here: the gateway lives on, the generation goes on for the new connection, and
    that connection holds no ticket (``resume`` admits no request). Consequence: while Redis is down (a ``local`` tier:
    plus, enterprise) a key limited to N streams in flight gets one more each time it resumes one of its streams on the
    same gateway (the ``max_concurrent`` bypass 3da0641 closed for drops, reopened). Fix: on a supersede hand the old
    connection's ticket to the new one (or end it as "dropped", after the window), not as a hand-over."""
    import asyncio

    from producers.gateway.admission import Admission
    from producers.gateway.service import HandedOver

    admission = Admission(FlakyShared(), LocalLimiter(), TierTable.model_validate({}))
    relay = Relay()
    chat = ChatService(GatewaySettings(instance_id="gw"), PROMPTS, RecordingPublisher(), relay, 0, "gw/1",  # type: ignore[arg-type]
                       admission=admission, tiers=TenancySettings().tiers.policies(), streams=Streams())  # type: ignore[arg-type]
    key = api_key(tier="plus", limits=LimitOverrides(max_concurrent=1))
    body = ChatCompletionRequest.model_validate({"model": "m", "stream": True,
                                                 "messages": [{"role": "user", "content": "hi"}]})
    accepted = await chat.accept(body, key, client_addr=None, traceparent="00-0-0-01")
    with pytest.raises(ApiError) as first:  # the key's one slot is taken
        await chat.accept(body, key, client_addr=None, traceparent="00-0-0-01")
    assert first.value.status == 429
    old = chat.stream(accepted)
    relay.collectors[accepted.request_id].put(delta(accepted.request_id, 0))
    await old.__anext__()
    await old.__anext__()
    await chat.resume(accepted.request_id, 0, key, traceparent="00-0-0-01")  # its client is back, same gateway
    with pytest.raises(HandedOver):
        await old.__anext__()
    for _ in range(5):
        await asyncio.sleep(0)
    await chat.drain()
    with pytest.raises(ApiError) as second:  # one stream in flight already: its generation goes on
        await chat.accept(body, key, client_addr=None, traceparent="00-0-0-01")
    assert (second.value.status, second.value.code) == (429, "rate_limit_exceeded")
    await chat.drain()
