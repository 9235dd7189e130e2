"""Request claims in the real Redis: first record wins, redelivery takes over or skips, older generations are
fenced."""

from __future__ import annotations

import uuid

import pytest
from redis.asyncio import Redis

from inference_workers.claims import ClaimVerdict, RequestClaims
from runtime.settings import Settings

pytestmark = pytest.mark.integration


def _rid() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


async def test_claim_lifecycle(redis: Redis, stack: Settings) -> None:
    w1 = RequestClaims(redis, stack.redis, worker_id="w1", ttl_s=60)
    w2 = RequestClaims(redis, stack.redis, worker_id="w2", ttl_s=60)
    rid = _rid()
    first = await w1.claim(rid, "requests:0:10", 5)
    assert (first.verdict, first.previous) == (ClaimVerdict.START, 0)
    # the same id in another record (an upstream retry) is a duplicate
    assert (await w1.claim(rid, "requests:3:99", 5)).verdict is ClaimVerdict.DUPLICATE
    # the same worker fetching the record again in the same generation goes on with its own attempt
    assert (await w1.claim(rid, "requests:0:10", 5)).verdict is ClaimVerdict.START
    # the partition's next owner (a newer generation) takes it over from attempt 5
    taken = await w2.claim(rid, "requests:0:10", 7)
    assert (taken.verdict, taken.previous) == (ClaimVerdict.START, 5)
    # the previous owner, still in generation 5, is fenced off: it learns which attempt has the request
    stale = await w1.claim(rid, "requests:0:10", 5)
    assert (stale.verdict, stale.previous) == (ClaimVerdict.STALE, 7)
    await w2.mark_done([rid])
    assert (await w2.claim(rid, "requests:0:10", 9)).verdict is ClaimVerdict.DONE


async def test_claims_expire_even_when_a_field_write_recreates_them(redis: Redis, stack: Settings) -> None:
    claims = RequestClaims(redis, stack.redis, worker_id="w1", ttl_s=60)
    rid = _rid()
    await claims.claim(rid, "requests:0:1", 1)
    assert 0 < await redis.ttl(claims._key(rid)) <= 60
    await claims.record_first_offset(rid, 42)
    await claims.record_first_offset(rid, 43)
    assert await claims.first_offset(rid) == 42  # the first recorded stays
    # Redis lost the claim (a restart without persistence); marking it done writes it again, with an expiry
    await redis.delete(claims._key(rid))
    await claims.mark_done([rid])
    assert 0 < await redis.ttl(claims._key(rid)) <= 60
