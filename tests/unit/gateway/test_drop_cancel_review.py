"""Adversarial review of 86f95a9 (issue 36 item 1, issue 37 C1), the gateway's side: what a dropped, resumed or
cancelled stream tells the workers and the limiter. Each test states a defect the review found, its consequence for
a user or a bill, and the code line (line numbers as of 86f95a9); each failed on 86f95a9 for that reason and passes
since its fix."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
from aiokafka.errors import KafkaTimeoutError
from prometheus_client import REGISTRY

from producers.gateway.errors import ApiError
from producers.gateway.protocol import ChatCompletionRequest
from producers.gateway.responses import ResponsesService
from producers.gateway.responses_protocol import ResponseCreate
from producers.gateway.service import Accepted, ChatService, HandedOver
from runtime.settings import GatewaySettings, TenancySettings
from schemas.events import LimitOverrides, TokenEvent, TokenUsage
from tests.fakes.conversations import Conversations, Responses, planner, prompts
from tests.fakes.conversations import Redis as TurnRedis
from tests.fakes.gateway import PROMPTS, RecordingPublisher, Relay, Streams
from tests.fakes.tenancy import api_key, local_admission

TRACE = "00-0-0-01"


def service(publisher: RecordingPublisher | None = None, **options: Any) -> tuple[ChatService, RecordingPublisher,
                                                                                   Relay]:
    publisher = publisher or RecordingPublisher()
    relay = Relay()
    turns = options.pop("turns", None)
    chat = ChatService(GatewaySettings(instance_id="gw", **options), PROMPTS, publisher, relay, 0,  # type: ignore[arg-type]
                       "gw/1", admission=local_admission(), tiers=TenancySettings().tiers.policies(),
                       streams=Streams(), turns=turns)  # type: ignore[arg-type]
    return chat, publisher, relay


def delta(request_id: str, seq: int) -> TokenEvent:
    return TokenEvent(request_id=request_id, attempt=1, seq=seq, token_offset=seq, token_ids=[seq], text=f" t{seq}",
                      worker_id="w", emitted_at_us=seq)


async def accept(chat: ChatService, key: Any = None, **body: Any) -> Accepted:
    request = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True, **body})
    return await chat.accept(request, key or api_key(), client_addr=None, traceparent=TRACE)


async def read_then_drop(chat: ChatService, relay: Relay, accepted: Accepted, tokens: int) -> None:
    """The client reads ``tokens`` deltas, then its connection drops (the response's task is cancelled)."""
    collector = relay.collectors[accepted.request_id]
    body = chat.stream(accepted)
    for seq in range(tokens):
        collector.put(delta(accepted.request_id, seq))
        if seq == 0:
            await body.__anext__()  # the role chunk, with the first output
        await body.__anext__()
    await body.aclose()  # type: ignore[attr-defined]
    await chat.drain()


def counter(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


# --- limits: a dropped stream's generation runs outside max_concurrent ----------------------------------------------


async def test_a_dropped_stream_keeps_its_in_flight_slot_while_its_generation_goes_on() -> None:
    """Defect: ``close`` ends the admission ticket of every stream that ends on this connection
    (``service.py`` lines 509-510), a dropped one too, although its generation goes on for the resume window; nothing
    takes the slot back while it runs (a background response's is held until its row says it ended:
    ``responses.py`` ``_hold``).

    Consequence: ``max_concurrent`` no longer bounds a key's generations: a key limited to 1 runs as many at once as
    its RPM times the window allows (30 s at enterprise's RPM: thousands), each dropped at its first byte; what the
    engine generates for them meanwhile is held and never billed (``fate="wasted"``). One tenant can fill the GPUs
    of every other tenant at the price of its prompts."""
    chat, _publisher, relay = service()
    key = api_key(limits=LimitOverrides(max_concurrent=1))
    first = await accept(chat, key)
    await read_then_drop(chat, relay, first, 1)  # detached: its generation goes on for 30 s
    with pytest.raises(ApiError) as refused:
        await accept(chat, key)
    assert refused.value.status == 429


# --- a resume's attach that landed though its produce failed ---------------------------------------------------------


class LostAckPublisher(RecordingPublisher):
    """A control record that reaches the log while its producer reports a failure (its ack lost, a timeout)."""

    async def attach(self, request_id: str, attachment: str, traceparent: str | None = None) -> None:
        await super().attach(request_id, attachment, traceparent)
        raise KafkaTimeoutError()


async def test_a_resume_refused_after_its_attach_reached_the_log_detaches_that_connection() -> None:
    """Defect: ``resume`` answers 503 when producing the ATTACH fails (``service.py`` lines 318-324), but a produce
    that reports failure may have landed (a lost ack: what ``_submit`` guards against with a cancel, line 269), and
    nothing ever detaches that connection. The worker then counts it attached, on a live gateway, for the rest of the
    generation (``listeners.py`` ``Connection.live``).

    Consequence: the stream is never held nor cancelled by its window: after the client gives up it is generated to
    ``max_tokens`` into the log and billed whole (a finished generation is), the work no longer bounded by the window
    and the client billed for an answer it left."""
    chat, publisher, relay = service(LostAckPublisher())
    accepted = await accept(chat)
    await read_then_drop(chat, relay, accepted, 2)
    with pytest.raises(ApiError) as refused:
        await chat.resume(accepted.request_id, 2, api_key(), traceparent=TRACE)
    await chat.drain()
    assert refused.value.status == 503
    (attached,) = publisher.attaches
    ended = [s.attachment for s in publisher.detaches + publisher.cancels]
    assert attached.attachment in ended


# --- a reconnect to the same gateway before it noticed the drop ------------------------------------------------------


async def test_a_client_reconnecting_to_the_same_gateway_before_it_noticed_the_drop_gets_its_stream() -> None:
    """Defect: a resume on the gateway process that still serves the stream's old connection is refused 409
    ``stream_in_use`` (``service.py`` lines 309-312, the relay's one-registration rule ``demux.py`` line 234). The
    connections of issue 36 (a Wi-Fi handover, a mobile network changing address) drop without a FIN or RST: the
    gateway notices only when a write fails, after TCP's retransmissions (minutes), and until then its relay keeps the
    old connection registered and the worker keeps it attached.

    Consequence: on a single gateway (or when the load balancer sends the client back to the same process) the
    resume promised by issue 36 fails with 409 for as long as the old socket lingers; a browser's EventSource does
    not retry a 409, and ``kns chaos`` has to (3489e24 ``bench/chaos/client.py``: "409 ... tried again")."""
    chat, _publisher, relay = service()
    accepted = await accept(chat)
    collector = relay.collectors[accepted.request_id]
    old = chat.stream(accepted)
    collector.put(delta(accepted.request_id, 0))
    await old.__anext__()  # the role chunk
    await old.__anext__()  # the first content: the client has position 1; then its network changes silently
    try:
        resumed = await chat.resume(accepted.request_id, 1, api_key(), traceparent=TRACE)
        assert resumed.attachment != accepted.attachment
    finally:
        with contextlib.suppress(BaseException):
            await old.aclose()  # type: ignore[attr-defined]
        await chat.drain()


# --- the Responses API: a foreground stream without store cannot be stopped -----------------------------------------


async def test_a_streamed_response_without_store_can_be_cancelled() -> None:
    """Defect: ``ResponsesService.cancel`` finds a response still generating through ``_running``, which answers 404
    for ``store: false`` (``responses.py`` line 283), before the new foreground cancel (lines 235-239) is reached; and
    the chat cancel endpoint refuses it as another API's stream (``service.py`` line 341).

    Consequence: a client whose streamed response (``store: false``) dropped cannot stop it by any endpoint: it is
    generated for the whole resume window for nobody, though issue 36 says a client that wants it stopped says so."""
    publisher = RecordingPublisher()
    chat, _, _ = service(publisher)
    responses = ResponsesService(chat, prompts(), planner(), Responses(), publisher)  # type: ignore[arg-type]
    body = ResponseCreate.model_validate({"model": "m", "input": "hi", "stream": True, "store": False,
                                          "max_output_tokens": 16})
    accepted, view = await responses.create(body, api_key(), client_addr=None, traceparent=TRACE)
    try:
        await responses.cancel(view.id, api_key(), traceparent=TRACE)
        assert publisher.cancelled == [view.id]
    finally:
        chat.close(accepted, "stop", stream=True)
        await chat.drain()


# --- conversations: a dropped turn holds the next one -----------------------------------------------------------------


async def test_the_next_turn_does_not_wait_out_turn_wait_s_for_a_turn_whose_client_dropped() -> None:
    """Defect: a dropped turn counts as one that "may still be appended" (``service.py`` ``_appended``, line 581,
    "dropped"), so its conversation's last-turn mark stays, and the next turn waits for its answer item
    (``turns.py`` ``_await_previous_turn``) up to ``turn_wait_s`` (10 s). The dropped turn is held by its worker
    (nobody attached) and cancelled at the window's end (30 s): a chat turn has no response row that could end the
    wait earlier (``_ended_unanswered``).

    Consequence: after a dropped connection, the user's next message of a conversation waits 10 s before it is even
    admitted, then goes on without the dropped turn; when that turn does end within its window it is appended after
    the next turn was answered without it (before 86f95a9 a drop cancelled the turn and forgot it at once)."""
    redis = TurnRedis()
    chat, _publisher, relay = service(turns=planner(conversations=Conversations(), redis=redis, turn_wait_s=0.3))
    first = await accept(chat, conversation_id="conv_1")
    await read_then_drop(chat, relay, first, 2)
    before = counter("kns_gateway_turn_waits_total", outcome="timed_out")
    second = await accept(chat, conversation_id="conv_1")
    chat.close(second, "stop", stream=True)
    await chat.drain()
    waited_out = counter("kns_gateway_turn_waits_total", outcome="timed_out") - before
    assert waited_out == 0


# --- metrics ----------------------------------------------------------------------------------------------------------


async def test_a_gateway_handing_over_its_streams_counts_no_dropped_client_connection() -> None:
    """Defect: ``_detach`` counts every detach in ``kns_gateway_dropped_connections_total`` (``service.py`` line 566),
    a stopping gateway's hand-over of its open streams too (line 531), though the metric says "Streamed client
    connections that dropped".

    Consequence: every rolling deploy of the gateways shows as a burst of client drops; the metric cannot tell client
    networks from the platform's own restarts."""
    chat, _publisher, relay = service()
    accepted = await accept(chat)
    relay.collectors[accepted.request_id].put(delta(accepted.request_id, 0))
    body = chat.stream(accepted)
    await body.__anext__()
    await body.__anext__()
    before = counter("kns_gateway_dropped_connections_total")
    chat.hand_over()
    with pytest.raises(HandedOver):
        await body.__anext__()
    await chat.drain()
    dropped = counter("kns_gateway_dropped_connections_total") - before
    assert dropped == 0


async def test_a_stream_its_worker_ended_as_cancelled_produces_no_cancel() -> None:
    """Defect: a final with ``finish_reason: cancelled`` (the explicit cancel's, or a window's seen by a resumer) is not
    a client finish reason, so ``stream`` ends with outcome "error" and ``close`` produces a CANCEL for a generation
    its worker has already ended (``service.py`` lines 536-541).

    Consequence: every explicit cancel is counted twice in ``kns_gateway_cancels_total`` (once per connection reading
    the stream, plus the endpoint's), and each adds a control event every worker reads and keeps."""
    chat, publisher, relay = service()
    accepted = await accept(chat)
    collector = relay.collectors[accepted.request_id]
    collector.put(delta(accepted.request_id, 0))
    collector.put(TokenEvent(request_id=accepted.request_id, attempt=1, seq=1, token_offset=1, token_ids=[],
                             text="", worker_id="w", emitted_at_us=1, finish_reason="cancelled",
                             usage=TokenUsage(prompt_tokens=3, completion_tokens=1, cached_tokens=0)))
    frames = [frame async for frame in chat.stream(accepted)]
    await chat.drain()
    assert frames[-1].endswith(b"[DONE]\n\n")
    assert publisher.cancels == []
