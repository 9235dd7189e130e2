"""Rate limits at the gateway, from an adversarial review of the change that wired them in. Each test fails on
the reviewed code, for the reason its docstring gives. ``LocalLimiter`` stands in for the shared (Redis) limiter
where only its settle-once / lease semantics matter: the Lua scripts in runtime/limiter.py behave the same way
(the reservation hash is deleted by the first settle; the in-flight ZSET member stays until released or settled
or its lease ends)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from redis.exceptions import TimeoutError as RedisTimeoutError

from producers.gateway import errors
from producers.gateway.admission import Admission
from producers.gateway.deps import authenticate
from producers.gateway.errors import ApiError
from producers.gateway.local_limiter import LocalLimiter
from producers.gateway.protocol import ChatCompletionRequest
from producers.gateway.routes import chat as chat_routes
from producers.relay.collector import StreamCollector
from runtime.limiter import Decision, Limits, Refused, Window
from runtime.settings import TierTable
from runtime.spend import BudgetHold
from schemas.events import LimitOverrides
from tests.fakes.gateway import Clock, RecordingPublisher, chat_service
from tests.fakes.tenancy import api_key
from tests.unit.gateway.test_submit_failures import TimedOutPublisher

TIERS = TierTable.model_validate({})


class Relay:
    def __init__(self) -> None:
        self.registered: set[str] = set()

    def register(self, request_id: str) -> StreamCollector:
        self.registered.add(request_id)
        return StreamCollector(request_id)

    def unregister(self, request_id: str) -> None:
        self.registered.discard(request_id)


def _body(stream: bool = True) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],  # type: ignore[list-item]
                                 stream=stream)


async def _settle_background(rounds: int = 20) -> None:
    for _ in range(rounds):
        await asyncio.sleep(0)


# --- 1. Redis flapping: the local limiter forgets everything at each answer ---------------------------------


class FlappingShared:
    """Redis answering one call in two (a socket timeout, then an answer: here the key's shared bucket is empty)."""

    def __init__(self) -> None:
        self.calls = 0

    async def admit(self, request_id: str, tokens: int, **_: Any) -> Decision:
        self.calls += 1
        if self.calls % 2:
            raise RedisTimeoutError("Timeout reading from socket")
        return Refused("requests", "key", 20_000, 3, Window(3, 0, 20_000, 10**6, 10**6, 0))

    async def release(self, request_id: str, **_: Any) -> None:
        pass

    async def settle(self, request_id: str, used_tokens: int, *, billed: bool = False) -> bool:
        return False


async def test_a_flapping_redis_does_not_lift_the_limits() -> None:
    """Promise 1 / 4 (local_limiter.py docstring: 'an outage costs at most one extra minute's worth of the
    share'). admission.py:75-77 calls ``self._local.forget()`` whenever the shared limiter answers after a local
    admission, and ``forget`` drops every local bucket: the next failure starts from full buckets again. Under a
    Redis that times out intermittently (a 2 s socket timeout under load, a BlockingConnectionPool that runs dry
    and raises ConnectionError after 5 s), every other request is admitted by a fresh local limiter, so a key
    limited to 3 requests per minute gets 50 of 100 admitted within the same instant. Fix: keep the local state
    (let it decay) and only stop using it once Redis has answered for a while, or never forget buckets younger
    than a minute."""
    admission = Admission(FlappingShared(), LocalLimiter(clock=Clock()), TIERS)
    key = api_key(tier="plus", limits=LimitOverrides(requests_per_minute=3))
    admitted = 0
    for i in range(100):
        try:
            await admission.admit(f"r{i}", 10, key)
            admitted += 1
        except ApiError:
            pass
    assert admitted <= 3, f"{admitted} requests admitted at 3 per minute (clock frozen)"


# --- 2. the admission ran on Redis, its reply was lost ------------------------------------------------------


class LostReply(LocalLimiter):
    """Redis ran the admission script (slots leased, tokens debited, reservation written), then the reply did not
    arrive within the socket timeout (an fsync stall, a failover, a network blip): redis-py raises TimeoutError."""

    def __init__(self) -> None:
        super().__init__()
        self.lose = True

    async def admit(self, request_id: str, tokens: int, *, key_id: str, org_id: str, key_limits: Limits,
                    org_limits: Limits, budget: BudgetHold | None = None) -> Decision:
        decision = await super().admit(request_id, tokens, key_id=key_id, org_id=org_id, key_limits=key_limits,
                                       org_limits=org_limits)
        if self.lose:
            raise RedisTimeoutError("Timeout reading from socket")
        return decision


async def test_an_admission_whose_reply_was_lost_leaves_no_slot_taken() -> None:
    """Promise 3. admission.py:78-92: when ``shared.admit`` raises (RedisError/OSError) the gateway answers 503
    (closed tier) or falls back to the local limiter, and never tells Redis about that request id again. But a
    socket timeout does not mean the script did not run: its lease stays in the key's and org's in-flight ZSETs
    for ``lease_s`` (900 s) and its reservation for ``reservation_ttl_s``; nothing will ever release or settle it
    (the request was never produced). Four such blips and a free-tier key (4 in flight) is refused
    'requests in flight' for 15 minutes with nothing in flight. ``ChatService._give_back`` has the same hole (it
    suppresses the error). Fix: after a failed shared admit, spawn a best-effort ``shared.release`` +
    ``shared.settle(request_id, 0)`` retried until Redis answers (both are idempotent), or make the admit script
    idempotent per request id and re-ask it."""
    shared = LostReply()
    admission = Admission(shared, LocalLimiter(), TIERS)
    key = api_key(tier="free")
    for i in range(4):
        with pytest.raises(ApiError) as raised:
            await admission.admit(f"lost-{i}", 10, key)
        assert raised.value.status == 503
    await _settle_background()
    shared.lose = False
    ticket = await admission.admit("next", 10, key)  # 429 'requests in flight': four ghosts hold the 4 slots
    assert ticket.request_id == "next"


# --- 3. an ambiguous produce failure settles the reservation with 0 -------------------------------------------


async def test_a_produce_that_may_have_reached_the_log_leaves_its_settlement_to_the_worker() -> None:
    """Promise 2 (settled counters == ledger, with produce failures). service.py:126-130: when ``submit`` raises,
    ``Admission.unsent`` settles the reservation with 0 at once (admission.py:104-106), deleting it and adding 0 to
    the settled counters. But a timed-out produce is ambiguous (test_submit_failures.py: the broker may have
    appended it, or the batch goes out after the error), which is why a cancel is produced - asynchronously, so it
    may reach the worker after the request finished (a short answer, or a control-topic lag). Then the worker
    commits a billed UsageEvent and settles it: the reservation is gone, the Lua settle returns 0 and does not
    INCRBY, and the ledger charges tokens the settled counters never see. Fix: on a produce failure only release
    the slots; leave the reservation to the worker's settlement (a cancelled request settles 0) and to its TTL
    (the tokens bucket refills within a minute anyway). test_admission.py's
    ``test_a_request_that_never_reached_kafka_gives_its_reservation_and_slot_back`` should then check only the
    slot."""
    shared = LocalLimiter()
    publisher = TimedOutPublisher()
    chat = chat_service(publisher, Relay(), admission=Admission(shared, LocalLimiter(), TIERS))
    with pytest.raises(ApiError):
        await chat.accept(_body(), api_key(tier="plus"), client_addr=None, traceparent="00-0-0-01")
    await chat.drain()
    (request,) = publisher.submitted
    # The record was in the log after all; the worker finished it before the cancel arrived and billed 3 + 8.
    assert await shared.settle(request.request_id, 11) is True, "the worker's billed settlement was dropped"


# --- 4. an admitted request's error answer has no x-ratelimit-* headers -----------------------------------------


def test_an_admitted_requests_error_answer_carries_the_rate_limit_headers() -> None:
    """Promise 5 (README: 'Every answer to an admitted request carries OpenAI's x-ratelimit-* headers').
    routes/chat.py:107-122: the headers are added only to the StreamingResponse and to the non-streaming
    JSONResponse of a success. A non-streaming request that was admitted (tokens reserved, slot taken) and then
    ends in 504 timeout, 503 queue_deadline_exceeded, 502 generation_failed or 400 content_filter raises ApiError
    out of ``answer.result()``; the error handler answers without them. Fix: catch ApiError in the route and
    re-raise it with ``accepted.ticket.headers()`` merged into its headers."""
    publisher = RecordingPublisher()
    chat = chat_service(publisher, Relay(), admission=Admission(LocalLimiter(), LocalLimiter(), TIERS),
                        queue_deadline_s=0.05, first_token_grace_s=0.05)
    app = FastAPI()
    errors.install(app)
    app.include_router(chat_routes.router)
    app.state.ctx = SimpleNamespace(chat=chat)
    app.dependency_overrides[authenticate] = lambda: api_key(tier="plus")
    with TestClient(app) as client:
        answer = client.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user",
                                                                                      "content": "hi"}]},
                             headers={"Authorization": "Bearer x"})
    assert answer.status_code == 504
    assert "x-ratelimit-remaining-requests" in answer.headers, "an admitted request's 504 has no rate headers"


# --- 5. local admissions whose usage is unknown are never settled --------------------------------------------


async def test_a_local_admission_ended_without_usage_leaves_no_reservation_behind() -> None:
    """Promise 3 (no reservation leaks), while Redis is down. admission.py:97-102: a locally admitted ticket is
    settled only when the gateway knows the usage; a client hang-up, a timeout or an error without a final
    (``used_tokens`` None) leaves its ``_Reservation`` in ``LocalLimiter._reservations`` forever - ``release``
    does not pop it (local_limiter.py:94-96), only ``forget()`` clears it, which needs Redis back. Over a long
    outage the dict grows by one entry per such request (memory), and the reservations hold references to dropped
    buckets. Fix: with unknown usage, settle with the whole reservation (tokens stay counted, the entry goes)."""

    class DeadShared(FlappingShared):
        async def admit(self, request_id: str, tokens: int, **_: Any) -> Decision:
            raise RedisTimeoutError("Timeout connecting to server")

    local = LocalLimiter()
    admission = Admission(DeadShared(), local, TIERS)
    ticket = await admission.admit("r1", 10, api_key(tier="plus"))
    assert ticket.local
    await admission.end(ticket, None)  # the client hung up before the final
    assert not local._reservations
