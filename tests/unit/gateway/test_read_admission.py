"""Read admission (issue 37 M2): list reads and resumes take a read from a bucket per key and per org (as many a
minute as the org's requests), apart from the requests' bucket; past it they are 429 in OpenAI's words, before the
route reads anything; with Redis down this process's own read buckets decide, whatever the tier."""

from __future__ import annotations

import socket
import time
from types import SimpleNamespace
from typing import Any

import pytest

from producers.gateway.admission import Admission
from producers.gateway.errors import ApiError
from producers.gateway.local_limiter import LocalLimiter
from producers.gateway.routes import conversations, stored, usage
from runtime.limiter import RateLimiter
from runtime.redis_client import make_redis
from runtime.settings import RedisSettings, TierTable
from schemas.events import LimitOverrides
from tests.fakes.gateway import Clock
from tests.fakes.tenancy import api_key

TIERS = TierTable.model_validate({})


def _dead_redis() -> RateLimiter:
    with socket.socket() as s:  # a port nobody listens on: connection refused, as with Redis down
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    settings = RedisSettings(url=f"redis://127.0.0.1:{port}/0")
    return RateLimiter(make_redis(settings), settings)


async def test_reads_past_the_orgs_rate_are_429_with_retry_after_and_the_rate_limit_headers() -> None:
    clock = Clock()
    admission = Admission(LocalLimiter(clock=clock), LocalLimiter(), TIERS)
    key = api_key(tier="free")  # 30 requests a minute: 30 reads
    windows = [await admission.admit_read(key) for _ in range(30)]
    assert [w.remaining for w in windows[-2:]] == [1, 0]
    with pytest.raises(ApiError) as raised:
        await admission.admit_read(key)
    error = raised.value
    assert (error.status, error.type, error.code) == (429, "requests", "rate_limit_exceeded")
    assert "API key k on reads per min (list reads and stream resumes): Limit 30" in error.message
    headers = error.headers or {}
    assert headers["retry-after"] == "2" and headers["retry-after-ms"] == "2000"  # 30 a minute: one per 2 s
    assert (headers["x-ratelimit-limit-requests"], headers["x-ratelimit-remaining-requests"]) == ("30", "0")
    assert headers["x-ratelimit-reset-requests"] == "1m0s"
    clock.now += 2
    await admission.admit_read(key)


async def test_the_read_rate_follows_the_orgs_own_request_rate() -> None:
    admission = Admission(LocalLimiter(clock=Clock()), LocalLimiter(), TIERS)
    key = api_key(tier="enterprise", limits=LimitOverrides(requests_per_minute=3))
    for _ in range(3):
        await admission.admit_read(key)
    with pytest.raises(ApiError):
        await admission.admit_read(key)


async def test_keys_of_one_org_share_its_read_bucket() -> None:
    admission = Admission(LocalLimiter(clock=Clock()), LocalLimiter(), TIERS)
    limits = LimitOverrides(requests_per_minute=4)
    first, second = api_key("k1", limits=limits), api_key("k2", limits=limits)
    for key in (first, first, first, second):
        await admission.admit_read(key)
    with pytest.raises(ApiError) as raised:
        await admission.admit_read(second)
    assert "organization org on reads per min" in raised.value.message


async def test_reads_and_requests_do_not_draw_on_each_others_bucket() -> None:
    admission = Admission(LocalLimiter(clock=Clock()), LocalLimiter(), TIERS)
    key = api_key(tier="plus", limits=LimitOverrides(requests_per_minute=2))
    for _ in range(2):
        await admission.admit_read(key)
    with pytest.raises(ApiError):
        await admission.admit_read(key)
    for n in range(2):  # the requests' bucket is whole
        await admission.end(await admission.admit(f"r{n}", 1, key))
    with pytest.raises(ApiError):
        await admission.admit("r2", 1, key)


async def test_with_redis_down_reads_of_a_closed_tier_are_admitted_by_the_local_read_buckets() -> None:
    local = LocalLimiter(clock=Clock())
    admission = Admission(_dead_redis(), local, TIERS)
    key = api_key(tier="free", limits=LimitOverrides(requests_per_minute=2))
    for _ in range(2):
        await admission.admit_read(key)
    with pytest.raises(ApiError) as raised:
        await admission.admit_read(key)
    assert raised.value.status == 429


class _Untouched:
    """A store the route must not reach once the read was refused."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the route read ({name}) although its read was refused")


def _refusing_context() -> tuple[Any, Any]:
    key = api_key(tier="free", limits=LimitOverrides(requests_per_minute=1))
    admission = Admission(LocalLimiter(clock=Clock()), LocalLimiter(), TIERS)
    ctx = SimpleNamespace(admission=admission, stored=_Untouched(), conversations=_Untouched(), ledger=_Untouched())
    return ctx, key


@pytest.mark.parametrize("route", ["stored completions", "stored messages", "conversations", "conversation items",
                                   "usage"])
async def test_a_list_read_past_the_read_rate_is_refused_before_it_reads(route: str) -> None:
    ctx, key = _refusing_context()
    await ctx.admission.admit_read(key)  # the bucket's one read
    calls = {
        "stored completions": lambda: stored.list_chat_completions(None, ctx, key, model=None, after=None, limit=20,
                                                                   order="desc"),
        "stored messages": lambda: stored.chat_completion_messages("chatcmpl-1", ctx, key, after=None, limit=20,
                                                                   order="desc"),
        "conversations": lambda: conversations.list_conversations(ctx, key, after=None, limit=20),
        "conversation items": lambda: conversations.list_items("conv_1", ctx, key, after=None, limit=20,
                                                               order="desc"),
        "usage": lambda: usage.usage(ctx, key, start=str(int(time.time()) - 3600), end=None, group_by="model"),
    }
    with pytest.raises(ApiError) as raised:
        await calls[route]()
    assert (raised.value.status, raised.value.code) == (429, "rate_limit_exceeded")


class _NoUsage:
    async def usage(self, *_args: Any) -> dict[str, Any]:
        return {}


async def test_a_usage_report_takes_a_read_per_week_of_its_range() -> None:
    """A report reads its range's days (a 93-day one costs the gateway ~0.2 s of CPU, a list read a few ms): a key
    asking for long reports as often as for lists must not get them as often (``kns bench flood``)."""
    key = api_key(tier="free")  # 30 reads a minute
    ctx = SimpleNamespace(admission=Admission(LocalLimiter(clock=Clock()), LocalLimiter(), TIERS), ledger=_NoUsage())
    now = int(time.time())

    async def report(days: int) -> dict[str, Any]:
        return await usage.usage(ctx, key, start=str(now - days * 86_400), end=str(now), group_by="day")  # type: ignore[arg-type]

    assert usage.read_cost(usage.MAX_RANGE) == 14 and usage.read_cost(usage.READ_SPAN) == 1
    for _ in range(2):
        await report(93)  # 14 reads each: 2 of the 30 left
    with pytest.raises(ApiError) as raised:
        await report(93)
    assert raised.value.status == 429 and (raised.value.headers or {})["retry-after"] == "24"  # 12 reads short
    for _ in range(2):
        await report(1)
    with pytest.raises(ApiError):
        await report(1)


async def test_a_read_that_costs_more_than_a_bucket_takes_the_whole_bucket_and_is_still_admissible() -> None:
    key = api_key(tier="free", limits=LimitOverrides(requests_per_minute=5))
    admission = Admission(LocalLimiter(clock=Clock()), LocalLimiter(), TIERS)
    await admission.admit_read(key, cost=14)
    with pytest.raises(ApiError):
        await admission.admit_read(key)
