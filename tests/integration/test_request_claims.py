"""Request claims in the real Redis: first record wins, redelivery restarts or skips."""

from __future__ import annotations

import uuid

import pytest
from redis.asyncio import Redis

from inference_workers.claims import ClaimVerdict, RequestClaims
from runtime.settings import Settings

pytestmark = pytest.mark.integration


async def test_claim_lifecycle(redis: Redis, stack: Settings) -> None:
    claims = RequestClaims(redis, stack.redis, worker_id="w1", ttl_s=60)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    first = await claims.claim(rid, "requests:0:10")
    assert (first.verdict, first.attempt) == (ClaimVerdict.START, 1)
    # the same id in another record (an upstream retry) is a duplicate
    assert (await claims.claim(rid, "requests:3:99")).verdict is ClaimVerdict.DUPLICATE
    # the same record again (rebalance before commit): generate again, as attempt 2
    again = await claims.claim(rid, "requests:0:10")
    assert (again.verdict, again.attempt) == (ClaimVerdict.START, 2)
    await claims.mark_done([rid])
    assert (await claims.claim(rid, "requests:0:10")).verdict is ClaimVerdict.DONE


async def test_claims_expire(redis: Redis, stack: Settings) -> None:
    claims = RequestClaims(redis, stack.redis, worker_id="w1", ttl_s=60)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    await claims.claim(rid, "requests:0:1")
    assert 0 < await redis.ttl(claims._key(rid)) <= 60
