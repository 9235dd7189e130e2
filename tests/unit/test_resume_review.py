"""Resumable streams and unattended billing under faults (pure logic over fakes), from an adversarial review of
the resume change: each test fails on the reviewed code for the reason in its docstring."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from inference_workers.presence import GatewayPresence
from producers.gateway.errors import ApiError
from producers.gateway.routes.chat import _last_event
from producers.gateway.service import ChatService, HandedOver
from producers.relay.collector import StreamCollector
from runtime.settings import GatewaySettings, RedisSettings
from runtime.streams import StreamRecord, parse_event_id
from schemas.events import ChatRequest, ControlAction, ControlEvent, ErrorCode, utcnow
from tests.fakes.engine import FakeEngine
from tests.fakes.gateway import PROMPTS, RecordingPublisher
from tests.fakes.kafka import FakeGroup
from tests.fakes.tenancy import api_key, local_admission
from tests.fakes.worker import make, pump, request, stop_made_workers


@pytest_asyncio.fixture(autouse=True, loop_scope="session")
async def _stop_made_workers() -> AsyncIterator[None]:
    yield
    await stop_made_workers()


# --- 1. a Last-Event-ID that is not ours must be a 400, never a 500 ---------------------------------------------


@pytest.mark.parametrize("value", ["chatcmpl-abc:\u00b2", "chatcmpl-abc:1\u00b3", "chatcmpl-abc:\u00b9"])
def test_a_last_event_id_with_a_superscript_digit_is_not_an_event_id(value: str) -> None:
    """Starlette decodes header bytes as latin-1, so a client sending byte 0xB2 in ``Last-Event-ID`` gives the
    gateway the character '²'. ``parse_event_id`` (runtime/streams.py) checks ``position.isdigit()``, which is
    True for superscript digits, then calls ``int(position)``, which raises ``ValueError``: the route
    (routes/chat.py ``_last_event``) lets it escape and the client gets ``500 internal_error`` instead of
    ``400 invalid_last_event_id``."""
    assert parse_event_id(value) is None


def test_the_route_answers_a_superscript_position_with_a_400() -> None:
    """The same defect seen from the route helper: an ApiError 400 is expected, a bare ValueError escapes."""
    with pytest.raises(ApiError) as raised:
        _last_event("chatcmpl-abc:\u00b2")
    assert raised.value.status == 400


# --- 2. SIGTERM while a resume is in flight ---------------------------------------------------------------------


class _Relay:
    def __init__(self) -> None:
        self.collectors: dict[str, StreamCollector] = {}

    async def resume(self, request_id: str, partition: int, from_offset: int, *, skip_through: int
                     ) -> StreamCollector:
        collector = self.collectors[request_id] = StreamCollector(request_id, skip_through=skip_through)
        return collector

    def unregister(self, request_id: str) -> None:
        self.collectors.pop(request_id, None)


class _SlowStreams:
    """The stream registry (Redis), answering the lookup only when the test says so."""

    def __init__(self) -> None:
        self.answer = asyncio.Event()

    async def lookup(self, request_id: str) -> StreamRecord:
        await self.answer.wait()
        return StreamRecord(request_id, "org", 5, 0, "m", 0, False, "gw/dead")

    async def listen(self, request_id: str, gateway_id: str) -> None:
        pass


async def test_a_resume_that_completes_while_the_gateway_hands_over_is_handed_over_too() -> None:
    """SIGTERM arrives (``hand_over``) while a resume is between its Redis lookup and its registration. The
    resume then adds the stream to ``_open`` after ``hand_over`` walked it: its collector is never failed with
    GATEWAY_STOPPING, so the stream is *not* handed over; it goes on until uvicorn's graceful-shutdown timeout
    (10 s) cancels the response task, whose ``finally`` (``_close``, outcome "cancelled") then produces a cancel:
    the generation is killed instead of continuing for the client to resume elsewhere. The same holds for a
    request accepted (``accept``) while the gateway hands over. (service.py resume/accept: ``self._open[...] =``
    with no check of ``self._handing_over``.)"""
    streams, relay, publisher = _SlowStreams(), _Relay(), RecordingPublisher()
    chat = ChatService(GatewaySettings(instance_id="gw"), PROMPTS, publisher, relay, 0, "gw/1",  # type: ignore[arg-type]
                       admission=local_admission(), streams=streams)  # type: ignore[arg-type]
    key = api_key()
    resuming = asyncio.ensure_future(chat.resume("chatcmpl-r", 3, key, traceparent="00-0-0-01"))  # type: ignore[arg-type]
    await asyncio.sleep(0)
    chat.hand_over()  # SIGTERM
    streams.answer.set()
    accepted = await resuming
    body = chat.stream(accepted)
    try:
        with pytest.raises(HandedOver):
            await asyncio.wait_for(body.__anext__(), 1.0)
    finally:
        await body.aclose()  # type: ignore[attr-defined]
        await chat.drain()


# --- 3. billing of an unattended stream after a worker failover -----------------------------------------------


class _Liveness:
    """The gateways' liveness keys (``mget``)."""

    def __init__(self, *alive: str) -> None:
        self.alive = set(alive)

    async def mget(self, keys: list[str]) -> list[str | None]:
        return ["1" if k.endswith(tuple(self.alive)) else None for k in keys]


def _copy(req: ChatRequest) -> ChatRequest:
    return req.model_copy(deep=True)


async def test_a_takeover_of_an_unattended_stream_still_bills_what_its_client_received() -> None:
    """w1 streams 3 tokens to a live gateway (its presence check sees the gateway and records them as attended),
    then the gateway dies and, within the resume window, w1 dies too. w2 takes the request over (prefix: the 3
    tokens the client received) in a fresh ``Job`` that knows nothing of w1's presence checks. Nobody resumes;
    after the grace w2 cancels it: the 3 tokens the client received while its gateway lived are billed, and the
    prompt. (Before, ``received_cap = attended_tokens = 0``: nothing billed at all.)"""
    group = FakeGroup()
    w1 = make("w1", group, FakeEngine(auto=False))
    w2 = make("w2", group, FakeEngine(auto=False))
    await w1.assign(0)
    req = request(max_tokens=100, gateway="gw/dead")
    await w1.handle(req, 0, 0)
    redis = _Liveness("gw/dead")
    first = GatewayPresence(redis, RedisSettings(), w1.intake, check_every_s=1,  # type: ignore[arg-type]
                            grace_s=0)
    w1.engine.step(req.request_id, 3)
    await pump()
    await first.check()  # the gateway relays it: the client has these 3 tokens
    assert w1.intake.jobs[req.request_id].listeners.received_cap(3) is None  # attended: everything is billed

    redis.alive = set()  # the gateway dies
    await w1.assign()  # then w1 dies: its partition moves, nothing committed
    await w2.assign(0)
    await w2.handle(_copy(req), 0, 0)
    await pump()
    assert w2.intake.jobs[req.request_id].tokens == 3  # took over from the 3 emitted tokens
    second = GatewayPresence(redis, RedisSettings(), w2.intake, check_every_s=1,  # type: ignore[arg-type]
                             grace_s=0)
    await second.check()  # nobody resumed it within the window: cancelled
    await w2.settle()
    assert [(u.prompt_tokens, u.completion_tokens) for u in group.usage] == [(4, 3)], (
        f"usage committed: {[(u.prompt_tokens, u.completion_tokens) for u in group.usage]}")


async def test_a_stream_a_live_gateway_relays_is_not_cancelled_after_redis_lost_every_stream_record() -> None:
    """The accepting gateway died; gateway B resumed the stream and is relaying it to its client. B's connection is
    known from the control topic (ATTACH), not from a Redis record, so Redis restarting empty (as the chaos Redis
    runs) changes nothing: B's liveness key is renewed every second and the stream goes on. (Before, the listener
    lived in the stream record: a restart lost it and the live stream was cancelled after the grace.)"""
    group = FakeGroup()
    worker = make("w1", group, FakeEngine(auto=False))
    await worker.assign(0)
    req = request(max_tokens=100, gateway="gw/dead")
    await worker.handle(req, 0, 0)
    redis = _Liveness("gw/resumer")
    worker.intake.on_control(ControlEvent(request_id=req.request_id, action=ControlAction.ATTACH, reason="resume",
                                          issued_by="gw/resumer", issued_at=utcnow(), attachment="r1"))
    presence = GatewayPresence(redis, RedisSettings(), worker.intake, check_every_s=1,  # type: ignore[arg-type]
                               grace_s=0)
    worker.engine.step(req.request_id, 2)
    await pump()
    await presence.check()
    await presence.check()
    await pump()
    job = worker.intake.jobs.get(req.request_id)
    assert job is not None and job.abort_cause is None, "a stream a live gateway relays was cancelled"


class _Streams:
    async def lookup(self, request_id: str) -> StreamRecord:
        return StreamRecord(request_id, "org", 5, 0, "m", 0, False, "gw/dead")

    async def listen(self, request_id: str, gateway_id: str) -> None:
        pass


async def test_a_resumed_stream_still_queued_waits_as_long_as_its_queue_deadline_allows() -> None:
    """A stream resumed before its first token (its gateway died while the request waited in the queue) is
    given ``stream_idle_timeout_s`` for its first token (``_patience``: ``not accepted.resumed``), not the queue
    deadline + grace the original connection had; the stream record does not even carry the deadline. With an
    idle timeout below deadline + grace (legal: the settings only require it to exceed two Kafka session
    timeouts, e.g. 30 s against the free tier's 30 + 30 s) the resuming gateway gives up first, answers 504 and
    *cancels* a request a worker would still have started. Scaled down here: idle 0.1 s, deadline 1 s + 1 s.
    (service.py _patience; runtime/streams.py StreamRecord has no deadline.)"""
    publisher = RecordingPublisher()
    chat = ChatService(GatewaySettings(instance_id="gw", stream_idle_timeout_s=0.1, queue_deadline_s=1.0,
                                       first_token_grace_s=1.0), PROMPTS, publisher, _Relay(), 0, "gw/1",  # type: ignore[arg-type]
                       admission=local_admission(), streams=_Streams())  # type: ignore[arg-type]
    accepted = await chat.resume("chatcmpl-q", -1, api_key(),  # type: ignore[arg-type]
                                 traceparent="00-0-0-01")
    body = chat.stream(accepted)
    try:
        with pytest.raises(TimeoutError):  # still waiting for its first token: no answer yet
            first = await asyncio.wait_for(body.__anext__(), 0.5)
            pytest.fail(f"the resumed stream gave up before the request's queue deadline: {first!r}")
    finally:
        await body.aclose()  # type: ignore[attr-defined]
        await chat.drain()


async def test_a_resumed_stream_whose_foreign_feed_dies_is_not_cancelled() -> None:
    """A resumed stream is relayed from another gateway's partition by a feed of its own. When that feed's
    consumer fails (``_Feed._run``: any exception from ``getmany`` or routing), ``fail_all`` ends its streams with
    GATEWAY_STOPPING; as the gateway is not handing over, ``stream`` sends the client an error event and
    ``[DONE]`` (so it will not resume) and ``_close`` (outcome "error") *cancels the generation*: one feed's
    fault on a healthy gateway kills every generation resumed from that partition, though the next resume would
    simply open a new feed (``Relay._feed`` replaces an unhealthy one). (demux.py _Feed._run/fail_all;
    service.py stream/_close.)"""
    publisher = RecordingPublisher()
    chat = ChatService(GatewaySettings(instance_id="gw"), PROMPTS, publisher, _Relay(), 0, "gw/1",  # type: ignore[arg-type]
                       admission=local_admission(), streams=_Streams())  # type: ignore[arg-type]
    accepted = await chat.resume("chatcmpl-f", 4, api_key(),  # type: ignore[arg-type]
                                 traceparent="00-0-0-01")
    accepted.collector.fail("the gateway's token relay failed", ErrorCode.GATEWAY_STOPPING)  # what fail_all does
    chunks: list[bytes] = []
    with contextlib.suppress(HandedOver):
        async for chunk in chat.stream(accepted):
            chunks.append(chunk)
    await chat.drain()
    assert publisher.cancelled == [], "the generation was cancelled because this gateway's feed failed"
    assert b"data: [DONE]\n\n" not in chunks, "the client was told the stream is over: it will not resume"
