"""Reply-partition claims in the real Redis: exclusive among live gateways, sticky across restarts."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from redis.asyncio import Redis

from producers.relay.claim import ReplyPartitionClaim
from runtime.redis_client import key
from runtime.settings import GatewaySettings, Settings
from schemas.errors import FatalError

pytestmark = pytest.mark.integration


def claim_for(redis: Redis, settings: Settings, instance: str, topic: str, ttl: float = 5.0,
              renew: float = 1.0) -> ReplyPartitionClaim:
    gateway = GatewaySettings(instance_id=instance, reply_lease_ttl_s=ttl, reply_lease_renew_s=renew)
    return ReplyPartitionClaim(redis, settings.redis, gateway, topic)


async def test_live_gateways_never_share_a_partition(redis: Redis, stack: Settings) -> None:
    topic = f"claims-{uuid.uuid4().hex}"
    claims = [claim_for(redis, stack, f"gw-{i}", topic) for i in range(3)]
    partitions = [await c.acquire(3) for c in claims]
    assert sorted(partitions) == [0, 1, 2]
    with pytest.raises(FatalError, match="all 3 reply partitions are claimed"):
        await claim_for(redis, stack, "gw-extra", topic).acquire(3)
    for c in claims:
        await c.close()


async def test_a_restarted_instance_gets_its_partition_back(redis: Redis, stack: Settings) -> None:
    topic = f"claims-{uuid.uuid4().hex}"
    first, other = claim_for(redis, stack, "gw-a", topic), claim_for(redis, stack, "gw-b", topic)
    await other.acquire(4)
    mine = await first.acquire(4)
    await first.close()  # process stops; its lease is still alive
    again = claim_for(redis, stack, "gw-a", topic)
    assert await again.acquire(4) == mine
    await again.close()
    await other.close()


async def test_home_partition_is_remembered_after_the_lease_expired(redis: Redis, stack: Settings) -> None:
    topic = f"claims-{uuid.uuid4().hex}"
    squatter = claim_for(redis, stack, "gw-z", topic, ttl=0.3)
    await squatter.acquire(4)  # takes partition 0
    gw = claim_for(redis, stack, "gw-home", topic, ttl=0.3)
    home = await gw.acquire(4)
    assert home == 1
    await gw.close()
    await squatter.close()
    await asyncio.sleep(0.5)  # both leases expire; partition 0 is now free too
    back = claim_for(redis, stack, "gw-home", topic)
    assert await back.acquire(4) == home
    await back.close()


async def test_losing_the_lease_is_noticed(redis: Redis, stack: Settings) -> None:
    topic = f"claims-{uuid.uuid4().hex}"
    gw = claim_for(redis, stack, "gw-lost", topic, ttl=2.0, renew=0.1)
    partition = await gw.acquire(1)
    await redis.set(key(stack.redis, "reply-lease", topic, partition), "intruder")
    await asyncio.wait_for(gw.lost.wait(), 2)
    await gw.close()
