"""How a stream ends at the gateway, and when the worker is told to stop (defect 3 of the correctness issue: a
request that timed out at the gateway was never cancelled, so under overload every queued request was later
generated to max_tokens and billed for nobody)."""

from __future__ import annotations

import asyncio
import time

import pytest

from producers.gateway.errors import ApiError
from producers.gateway.service import Accepted, ChatService
from producers.relay.collector import StreamCollector
from runtime.settings import GatewaySettings
from schemas.events import TokenEvent, TokenUsage
from tests.fakes.gateway import RecordingPublisher
from tests.fakes.tenancy import local_admission
from tests.fakes.worker import request


class Relay:
    def unregister(self, request_id: str) -> None:
        pass


def service(**settings: float) -> tuple[ChatService, RecordingPublisher]:
    publisher = RecordingPublisher()
    gateway = GatewaySettings(instance_id="gw", **settings)  # type: ignore[arg-type]
    return ChatService(gateway, None, publisher, Relay(), 0, "gw/1", admission=local_admission()), publisher  # type: ignore[arg-type]


def accepted() -> Accepted:
    req = request()
    return Accepted(req, StreamCollector(req.request_id), "00-0-0-01", False, time.perf_counter())


async def test_a_stream_that_times_out_at_the_gateway_cancels_the_generation() -> None:
    chat, publisher = service(queue_deadline_s=0.05, first_token_grace_s=0.05)
    item = accepted()
    chunks = [chunk async for chunk in chat.stream(item)]
    assert b'"code":"timeout"' in chunks[-2] and chunks[-1] == b"data: [DONE]\n\n"
    await chat.drain()
    assert publisher.cancelled == [item.request_id]


async def test_a_non_streaming_timeout_is_a_504_and_cancels_too() -> None:
    chat, publisher = service(queue_deadline_s=0.05, first_token_grace_s=0.05)
    item = accepted()
    with pytest.raises(ApiError) as raised:
        await chat.complete(item)
    assert (raised.value.status, raised.value.code) == (504, "timeout")
    await chat.drain()
    assert publisher.cancelled == [item.request_id]


def final(item: Accepted, finish_reason: str, **fields: object) -> TokenEvent:
    return TokenEvent(request_id=item.request_id, attempt=1, seq=0, token_offset=0, token_ids=[7], text=" ok",
                      finish_reason=finish_reason, usage=TokenUsage(prompt_tokens=3, completion_tokens=1),
                      worker_id="w", emitted_at_us=0, **fields)  # type: ignore[arg-type]


async def test_a_stream_the_worker_finished_is_not_cancelled() -> None:
    chat, publisher = service()
    item = accepted()
    item.collector.put(final(item, "stop"))
    answer = await chat.complete(item)
    assert answer["choices"][0]["message"]["content"] == " ok"  # type: ignore[index]
    await chat.drain()
    assert publisher.cancelled == []


async def test_a_deadline_refusal_is_a_503_and_still_cancels_a_generation_that_may_have_started() -> None:
    """The refusal may come from a pre-filter replaying its input while a worker already generates the request
    (at-least-once): the cancel makes sure nothing is generated for nobody."""
    chat, publisher = service()
    item = accepted()
    item.collector.put(final(item, "error", error="waited too long", error_code="queue_deadline_exceeded"))
    with pytest.raises(ApiError) as raised:
        await chat.complete(item)
    assert (raised.value.status, raised.value.code) == (503, "queue_deadline_exceeded")
    await chat.drain()
    assert publisher.cancelled == [item.request_id]


async def test_an_inconsistent_stream_ends_in_error_and_cancels_the_generation() -> None:
    chat, publisher = service()
    item = accepted()

    def ev(seq: int) -> TokenEvent:
        return TokenEvent(request_id=item.request_id, attempt=1, seq=seq, token_offset=seq, token_ids=[seq],
                          text=f" {seq}", worker_id="w", emitted_at_us=0)

    item.collector.put(ev(0))
    item.collector.put(ev(2))  # seq 1 lost
    chunks = [chunk async for chunk in chat.stream(item)]
    assert b'"code":"stream_inconsistent"' in chunks[-2]
    await asyncio.sleep(0)
    await chat.drain()
    assert publisher.cancelled == [item.request_id]
