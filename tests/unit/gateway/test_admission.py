"""Admission: the process-local limiter's arithmetic, the Redis-down policies (against a real client whose Redis
does not answer), the 429's shape, and the reservation given back when a request never reached Kafka."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest

from producers.gateway.admission import Admission, limits_for
from producers.gateway.errors import ApiError
from producers.gateway.local_limiter import LocalLimiter
from producers.gateway.protocol import ChatCompletionRequest
from producers.gateway.service import ChatService
from runtime.limiter import Admitted, Decision, Limits, RateLimiter, Refused
from runtime.redis_client import make_redis
from runtime.settings import RedisSettings, TierTable
from schemas.events import LimitOverrides
from tests.fakes.gateway import Clock, chat_service
from tests.fakes.tenancy import api_key
from tests.unit.gateway.test_submit_failures import Relay, TimedOutPublisher

TIERS = TierTable.model_validate({})


def wide(**given: int) -> Limits:
    return Limits(**{"requests_per_minute": 10**6, "tokens_per_minute": 10**9, "max_concurrent": 10**6, **given})


async def test_the_local_limiter_admits_exactly_the_bucket_then_refills_with_time() -> None:
    clock = Clock()
    local = LocalLimiter(clock=clock)
    limits = wide(requests_per_minute=6)
    answers = [await local.admit(f"r{i}", 1, key_id="k", org_id="o", key_limits=limits, org_limits=wide())
               for i in range(10)]
    assert [isinstance(a, Admitted) for a in answers] == [True] * 6 + [False] * 4
    refused = answers[6]
    assert isinstance(refused, Refused) and (refused.limit, refused.scope) == ("requests", "key")
    assert refused.retry_after_ms == 10_000  # one request per 10 s
    clock.now += 10
    assert isinstance(await local.admit("later", 1, key_id="k", org_id="o", key_limits=limits,
                                        org_limits=wide()), Admitted)


async def test_the_local_limiter_reserves_tokens_and_settles_them_once() -> None:
    local = LocalLimiter(clock=Clock())
    org = wide(tokens_per_minute=1000)
    assert isinstance(await local.admit("a", 600, key_id="k", org_id="o", key_limits=wide(), org_limits=org),
                      Admitted)
    refused = await local.admit("b", 600, key_id="k", org_id="o", key_limits=wide(), org_limits=org)
    assert isinstance(refused, Refused) and (refused.limit, refused.scope) == ("tokens", "org")
    assert await local.settle("a", 100) is True and await local.settle("a", 100) is False
    assert isinstance(await local.admit("b", 600, key_id="k", org_id="o", key_limits=wide(), org_limits=org),
                      Admitted)
    too_big = await local.admit("c", 5000, key_id="k", org_id="o", key_limits=wide(), org_limits=org)
    assert isinstance(too_big, Refused) and too_big.retry_after_ms == -1


async def test_the_local_limiter_counts_requests_in_flight_and_its_share() -> None:
    local = LocalLimiter(share=0.5, clock=Clock())
    limits = wide(max_concurrent=4)  # half of 4 in this process
    first = [await local.admit(f"r{i}", 1, key_id="k", org_id="o", key_limits=limits, org_limits=wide())
             for i in range(3)]
    assert [isinstance(a, Admitted) for a in first] == [True, True, False]
    assert isinstance(first[2], Refused) and first[2].limit == "concurrent"
    await local.release("r0", key_id="k", org_id="o")
    assert isinstance(await local.admit("r3", 1, key_id="k", org_id="o", key_limits=limits, org_limits=wide()),
                      Admitted)


def test_an_orgs_own_limits_override_its_tiers() -> None:
    assert limits_for(api_key(tier="free").org, TIERS) == Limits(30, 20_000, 4)
    own = api_key(tier="free", limits=LimitOverrides(requests_per_minute=500))
    assert limits_for(own.org, TIERS) == Limits(500, 20_000, 4)


def _dead_redis() -> RateLimiter:
    with socket.socket() as s:  # a port nobody listens on: connection refused, as with Redis down
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    settings = RedisSettings(url=f"redis://127.0.0.1:{port}/0")
    return RateLimiter(make_redis(settings), settings)


async def test_with_redis_down_the_free_tier_is_closed_with_a_503() -> None:
    admission = Admission(_dead_redis(), LocalLimiter(), TIERS)
    with pytest.raises(ApiError) as raised:
        await admission.admit("r1", 10, api_key(tier="free"))
    assert (raised.value.status, raised.value.code) == (503, "service_unavailable")
    assert "free tier" in raised.value.message


async def test_with_redis_down_paid_tiers_are_admitted_by_the_local_limiter_within_its_limits() -> None:
    local = LocalLimiter()
    admission = Admission(_dead_redis(), local, TIERS)
    key = api_key(tier="plus", limits=LimitOverrides(requests_per_minute=3))
    tickets = [await admission.admit(f"r{i}", 10, key) for i in range(3)]
    assert all(t.local and t.limiter is local for t in tickets)
    with pytest.raises(ApiError) as raised:
        await admission.admit("r4", 10, key)
    assert (raised.value.status, raised.value.code) == (429, "rate_limit_exceeded")


async def test_a_429_says_which_limit_and_when_to_retry_in_openais_words() -> None:
    admission = Admission(LocalLimiter(clock=Clock()), LocalLimiter(), TIERS)
    key = api_key(tier="free")
    for i in range(30):  # one after another: the free tier's 4 in flight are never reached
        await admission.end(await admission.admit(f"r{i}", 1, key))
    with pytest.raises(ApiError) as raised:
        await admission.admit("r30", 1, key)
    error = raised.value
    assert (error.status, error.type, error.code) == (429, "requests", "rate_limit_exceeded")
    assert "requests per min (RPM): Limit 30" in error.message
    headers = error.headers or {}
    assert headers["retry-after"] == "2" and headers["retry-after-ms"] == "2000"  # 30 per minute: one per 2 s
    assert headers["x-ratelimit-limit-requests"] == "30" and headers["x-ratelimit-remaining-requests"] == "0"
    with pytest.raises(ApiError) as too_big:
        await Admission(LocalLimiter(), LocalLimiter(), TIERS).admit("big", 50_000, key)
    assert too_big.value.code == "rate_limit_exceeded" and "Request too large" in too_big.value.message
    assert "retry-after" not in (too_big.value.headers or {})  # it would never pass: no time to wait for


async def test_a_request_whose_produce_failed_frees_its_slot_and_leaves_its_tokens_to_the_worker() -> None:
    shared = LocalLimiter()
    chat = chat_service(TimedOutPublisher(), Relay(), admission=Admission(shared, LocalLimiter(), TIERS))
    key = api_key(tier="free")
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], stream=True)
    with pytest.raises(ApiError):
        await chat.accept(body, key, client_addr=None, traceparent="00-0-0-01")
    await chat.drain()
    assert not any(shared._flights.values())  # the client's answer is over
    # A timed-out produce may be in the log after all: a worker that finishes it settles the reservation
    assert list(shared._reservations) == [chat_request_id(chat)]


def chat_request_id(chat: ChatService) -> str:
    (request,) = chat._publisher.submitted  # type: ignore[attr-defined]
    return str(request.request_id)


class SlowLimiter(LocalLimiter):
    """Redis taking its time to answer an admission."""

    def __init__(self) -> None:
        super().__init__()
        self.decided, self.answer = asyncio.Event(), asyncio.Event()

    async def admit(self, *args: Any, **kwargs: Any) -> Decision:
        decision = await super().admit(*args, **kwargs)
        self.decided.set()
        await self.answer.wait()
        return decision


async def test_a_client_gone_while_its_admission_is_decided_leaves_no_slot_taken() -> None:
    shared = SlowLimiter()
    chat = chat_service(TimedOutPublisher(), Relay(), admission=Admission(shared, LocalLimiter(), TIERS))
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], stream=True)
    accepting = asyncio.create_task(chat.accept(body, api_key(tier="free"), client_addr=None,
                                                traceparent="00-0-0-01"))
    await shared.decided.wait()
    accepting.cancel()  # the client hung up: Starlette cancels the request's task
    with pytest.raises(asyncio.CancelledError):
        await accepting
    shared.answer.set()
    await chat.drain()
    assert not shared._reservations and not any(shared._flights.values())
