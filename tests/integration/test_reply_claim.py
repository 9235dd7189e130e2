"""Reply-partition claims in the real Redis: exclusive among live gateways, sticky across restarts."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from redis.asyncio import Redis

from producers.relay.claim import ReplyPartitionClaim
from runtime.redis_client import gateway_alive_key, key, make_redis
from runtime.settings import GatewaySettings, Settings
from schemas.errors import FatalError
from tests.helpers import wait_for

pytestmark = pytest.mark.integration


def claim_for(redis: Redis, settings: Settings, instance: str, topic: str, ttl: float = 5.0,
              renew: float = 1.0) -> ReplyPartitionClaim:
    gateway = GatewaySettings(instance_id=instance, reply_lease_ttl_s=ttl, reply_lease_renew_s=renew)
    return ReplyPartitionClaim(redis, settings.redis, gateway, topic)


async def test_live_gateways_never_share_a_partition(redis: Redis, stack: Settings) -> None:
    """Gateways that start at the same moment race for the partitions: six claim three at once, each over a Redis
    connection of its own (as six processes would), three times over. Every partition goes to exactly one; the
    others are refused, clearly."""
    for _ in range(3):
        topic = f"claims-{uuid.uuid4().hex}"
        clients = [make_redis(stack.redis) for _ in range(6)]
        claims = [claim_for(client, stack, f"gw-{i}", topic) for i, client in enumerate(clients)]
        try:
            outcomes = await asyncio.gather(*(c.acquire(3) for c in claims), return_exceptions=True)
            won = sorted(o for o in outcomes if isinstance(o, int))
            refused = [o for o in outcomes if isinstance(o, FatalError)]
            assert won == [0, 1, 2], outcomes
            assert len(refused) == 3 and all("all 3 reply partitions are claimed" in str(e) for e in refused)
            owners = [await redis.get(key(stack.redis, "reply-lease", topic, p)) for p in range(3)]
            assert len(set(owners)) == 3 and None not in owners, owners  # one live gateway per partition
        finally:
            for c, o in zip(claims, outcomes, strict=True):
                if isinstance(o, int):
                    await c.close()
            for client in clients:
                await client.aclose()


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
    # Renewed four times per TTL, and a TTL long enough that a stalled test process does not lose the squatter's
    # lease before gw-home claims: only the expiry after close() is waited for, and it is waited for as a condition.
    squatter = claim_for(redis, stack, "gw-z", topic, ttl=2.0, renew=0.5)
    assert await squatter.acquire(4) == 0
    gw = claim_for(redis, stack, "gw-home", topic, ttl=2.0, renew=0.5)
    home = await gw.acquire(4)
    assert home == 1
    await gw.close()
    await squatter.close()
    leases = [key(stack.redis, "reply-lease", topic, p) for p in (0, 1)]
    # both processes stopped: once their leases expire, partition 0 is free too
    assert await wait_for(lambda: _none_exist(redis, leases), timeout_s=10)
    back = claim_for(redis, stack, "gw-home", topic)
    assert await back.acquire(4) == home
    await back.close()


async def _none_exist(redis: Redis, keys: list[str]) -> bool:
    return await redis.exists(*keys) == 0


async def test_a_lease_lost_in_a_redis_restart_is_taken_again_and_the_gateway_keeps_serving(
        redis: Redis, stack: Settings) -> None:
    """Defect 6: a lost reply lease stopped every gateway at once, so a Redis restart without persistence (which
    loses every lease) took the whole API down."""
    topic = f"claims-{uuid.uuid4().hex}"
    gw = claim_for(redis, stack, "gw-lost", topic, ttl=2.0, renew=0.1)
    partition = await gw.acquire(1)
    lease = key(stack.redis, "reply-lease", topic, partition)
    alive = gateway_alive_key(stack.redis, gw.gateway_id)
    await redis.delete(lease, alive)  # what a Redis restarted without persistence looks like to this gateway
    assert await wait_for(lambda: redis.get(lease), timeout_s=2) == "gw-lost"
    assert await redis.exists(alive) and not gw.shared and gw.partition == partition
    await redis.set(lease, "intruder")  # another instance took the partition meanwhile: both serve it
    assert await wait_for(lambda: gw.shared, timeout_s=2)
    await gw.close()
    assert not await redis.exists(alive)  # a gateway that stops says so at once
