"""Issue 36: what the gateway tells the worker when a client connection ends. A streamed client whose connection
drops is detached (what it received, its tier's window), not cancelled; a resume attaches its own connection; only
a window of 0, a non-streamed request, the gateway giving up or an explicit cancel stop the generation at once."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from producers.gateway.errors import ApiError
from producers.gateway.protocol import ChatCompletionRequest
from producers.gateway.service import ChatService, HandedOver
from runtime.settings import GatewaySettings, TenancySettings
from runtime.streams import StreamRecord
from schemas.events import ORIGIN_ATTACHMENT, LimitOverrides, TokenEvent
from tests.fakes.gateway import PROMPTS, RecordingPublisher, Relay, Streams
from tests.fakes.tenancy import api_key, local_admission


def service(**gateway: float) -> tuple[ChatService, RecordingPublisher, Relay, Streams]:
    publisher, relay, streams = RecordingPublisher(), Relay(), Streams()
    tiers = TenancySettings().tiers.policies()
    tiers["free"] = tiers["free"].model_copy(update={"resume_window_s": 5.0})
    chat = ChatService(GatewaySettings(instance_id="gw", **gateway), PROMPTS, publisher, relay, 0,  # type: ignore[arg-type]
                       "gw/1", admission=local_admission(), tiers=tiers, streams=streams)  # type: ignore[arg-type]
    return chat, publisher, relay, streams


def delta(request_id: str, seq: int) -> TokenEvent:
    return TokenEvent(request_id=request_id, attempt=1, seq=seq, token_offset=seq, token_ids=[seq], text=f" t{seq}",
                      worker_id="w", emitted_at_us=seq)


async def read_then_drop(chat: ChatService, relay: Relay, accepted: object, tokens: int, *, had: int = 0) -> None:
    """The client (which had ``had`` deltas on an earlier connection) reads ``tokens`` more, then its connection
    drops (the response's task is cancelled)."""
    collector = relay.collectors[accepted.request_id]  # type: ignore[attr-defined]
    for seq in range(had):  # a resume reads the stream from its start; what the client had is skipped
        collector.put(delta(accepted.request_id, seq))  # type: ignore[attr-defined]
    body = chat.stream(accepted)  # type: ignore[arg-type]
    for seq in range(had, had + tokens):
        collector.put(delta(accepted.request_id, seq))  # type: ignore[attr-defined]
        if seq == 0:
            await body.__anext__()  # the role chunk, with the first output
        await body.__anext__()
    await body.aclose()  # type: ignore[attr-defined]
    await chat.drain()


async def accept(chat: ChatService, tier: str = "plus", *, stream: bool = True) -> object:
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], stream=stream)
    return await chat.accept(body, api_key(tier=tier), client_addr=None, traceparent="00-0-0-01")


async def test_a_dropped_stream_is_detached_with_what_its_client_received_and_its_tiers_window() -> None:
    chat, publisher, relay, _ = service()
    for tier, window in (("plus", 30.0), ("free", 5.0)):
        accepted = await accept(chat, tier)
        await read_then_drop(chat, relay, accepted, 3)
        assert publisher.detaches[-1] == type(publisher.detaches[-1])(
            accepted.request_id, 3, ORIGIN_ATTACHMENT, window)  # type: ignore[attr-defined]
    assert publisher.cancels == []


async def test_a_window_of_zero_cancels_a_dropped_stream_at_once_as_before() -> None:
    chat, publisher, relay, _ = service(resume_window_s=0)
    accepted = await accept(chat)
    await read_then_drop(chat, relay, accepted, 2)
    assert publisher.detaches == []
    assert [(c.request_id, c.delivered_tokens, c.attachment) for c in publisher.cancels] == [
        (accepted.request_id, 2, ORIGIN_ATTACHMENT)]  # type: ignore[attr-defined]


async def test_a_non_streaming_client_that_hangs_up_cancels_at_once() -> None:
    chat, publisher, _, _ = service()
    accepted = await accept(chat, stream=False)
    answering = asyncio.ensure_future(chat.complete(accepted))  # type: ignore[arg-type]
    await asyncio.sleep(0)
    answering.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await answering
    await chat.drain()
    assert publisher.cancelled == [accepted.request_id] and publisher.detaches == []  # type: ignore[attr-defined]


async def test_a_resume_attaches_a_connection_of_its_own_and_its_drop_detaches_that_one() -> None:
    chat, publisher, relay, _streams = service()
    accepted = await accept(chat)
    await read_then_drop(chat, relay, accepted, 2)
    resumed = await chat.resume(accepted.request_id, 2, api_key(), traceparent="00-0-0-01")  # type: ignore[attr-defined]
    (attached,) = publisher.attaches
    assert attached.attachment == resumed.attachment != ORIGIN_ATTACHMENT
    await read_then_drop(chat, relay, resumed, 5, had=2)
    assert [(d.attachment, d.delivered_tokens) for d in publisher.detaches] == [
        (ORIGIN_ATTACHMENT, 2), (resumed.attachment, 7)]
    assert publisher.cancels == []


async def test_a_gateway_handing_over_detaches_its_streams_for_their_clients_to_resume_elsewhere() -> None:
    chat, publisher, relay, _ = service()
    accepted = await accept(chat)
    relay.collectors[accepted.request_id].put(delta(accepted.request_id, 0))  # type: ignore[attr-defined]
    body = chat.stream(accepted)  # type: ignore[arg-type]
    await body.__anext__()
    await body.__anext__()
    chat.hand_over()
    with pytest.raises(HandedOver):
        await body.__anext__()
    await chat.drain()
    assert [(d.delivered_tokens, d.window_s) for d in publisher.detaches] == [(1, 30.0)] and not publisher.cancels


async def test_an_explicit_cancel_names_no_connection_and_is_refused_for_another_org_or_an_ended_stream() -> None:
    chat, publisher, _, streams = service()
    accepted = await accept(chat)
    request_id = accepted.request_id  # type: ignore[attr-defined]
    with pytest.raises(ApiError) as foreign:
        await chat.cancel_stream(request_id, api_key(key_id="k9", org_id="other"), traceparent="00-0-0-01")  # type: ignore[arg-type]
    with pytest.raises(ApiError) as unknown:
        await chat.cancel_stream("chatcmpl-nope", api_key(), traceparent="00-0-0-01")
    assert foreign.value.status == unknown.value.status == 404 and publisher.cancels == []
    await chat.cancel_stream(request_id, api_key(), traceparent="00-0-0-01")
    assert [(c.request_id, c.attachment, c.delivered_tokens) for c in publisher.cancels] == [(request_id, None, None)]
    streams.done.add(request_id)
    with pytest.raises(ApiError) as ended:
        await chat.cancel_stream(request_id, api_key(), traceparent="00-0-0-01")
    assert (ended.value.status, ended.value.code, len(publisher.cancels)) == (409, "completion_finished", 1)


async def test_resumes_take_reads_of_their_key_and_past_its_reads_per_minute_get_429_before_any_lookup() -> None:
    """Issue 37 M2: a resume generates nothing but reads the log again (a far one on a consumer of its own)."""
    chat, _, relay, streams = service()
    accepted = await accept(chat)
    await read_then_drop(chat, relay, accepted, 1)
    lookups = []
    real_lookup = streams.lookup

    async def counting(request_id: str) -> StreamRecord | None:
        lookups.append(request_id)
        return await real_lookup(request_id)

    streams.lookup = counting  # type: ignore[method-assign]
    key = api_key(limits=LimitOverrides(requests_per_minute=1))
    await chat.resume(accepted.request_id, 1, key, traceparent="00-0-0-01")  # type: ignore[attr-defined]
    with pytest.raises(ApiError) as refused:
        await chat.resume(accepted.request_id, 1, key, traceparent="00-0-0-01")  # type: ignore[attr-defined]
    assert (refused.value.status, refused.value.code, len(lookups)) == (429, "rate_limit_exceeded", 1)


async def test_a_key_restricted_to_other_models_finds_neither_the_stream_to_resume_nor_to_cancel() -> None:
    """Issue 37 L6: a key's model allow-list applies to resumes and cancels as to creates: another model's stream is
    answered as unknown (404), as another org's."""
    chat, publisher, relay, _ = service()
    accepted = await accept(chat)
    await read_then_drop(chat, relay, accepted, 1)
    narrow = api_key(key_id="k2", models=["another-model"])
    with pytest.raises(ApiError) as resumed:
        await chat.resume(accepted.request_id, 1, narrow, traceparent="00-0-0-01")  # type: ignore[attr-defined]
    with pytest.raises(ApiError) as cancelled:
        await chat.cancel_stream(accepted.request_id, narrow, traceparent="00-0-0-01")  # type: ignore[attr-defined]
    assert resumed.value.status == cancelled.value.status == 404 and publisher.cancels == []
