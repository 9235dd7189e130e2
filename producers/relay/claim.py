"""The reply-partition claim: which partition of the token topic this gateway instance tails.

A claim is a Redis lease (``SET NX PX``) per partition, renewed while the gateway lives, so no two live
gateways ever share a partition. Each instance also remembers its "home" partition (no expiry): a restarted
instance takes its home back when it is free, so a claim survives a restart of the same instance.
"""

from __future__ import annotations

import asyncio
import logging

from redis.asyncio import Redis
from redis.exceptions import RedisError

from runtime.redis_client import key
from runtime.settings import GatewaySettings, RedisSettings
from schemas.errors import FatalError

log = logging.getLogger(__name__)

# KEYS[1..n]: lease keys of partitions 0..n-1; KEYS[n+1]: the instance's home key. ARGV: instance, ttl_ms.
_CLAIM = """
local n = #KEYS - 1
local me, ttl = ARGV[1], ARGV[2]
local function ours_or_free(p)
  local owner = redis.call('GET', KEYS[p + 1])
  if owner == me then redis.call('PEXPIRE', KEYS[p + 1], ttl) return true end
  if not owner then redis.call('SET', KEYS[p + 1], me, 'PX', ttl) return true end
  return false
end
local home = tonumber(redis.call('GET', KEYS[n + 1]))
if home and home < n and ours_or_free(home) then return home end
for p = 0, n - 1 do
  if redis.call('GET', KEYS[p + 1]) == me then
    redis.call('PEXPIRE', KEYS[p + 1], ttl) redis.call('SET', KEYS[n + 1], p) return p
  end
end
for p = 0, n - 1 do
  if ours_or_free(p) then redis.call('SET', KEYS[n + 1], p) return p end
end
return -1
"""

_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""


class ReplyPartitionClaim:
    def __init__(self, redis: Redis, redis_settings: RedisSettings, gateway: GatewaySettings, topic: str) -> None:
        self._redis = redis
        self._instance = gateway.instance_id
        self._ttl_ms = int(gateway.reply_lease_ttl_s * 1000)
        self._renew_every = gateway.reply_lease_renew_s
        self._lease_key = lambda p: key(redis_settings, "reply-lease", topic, p)
        self._home_key = key(redis_settings, "reply-home", topic, self._instance)
        self.partition: int | None = None
        self.lost = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def acquire(self, partitions: int) -> int:
        keys = [self._lease_key(p) for p in range(partitions)] + [self._home_key]
        claimed = int(await self._redis.eval(_CLAIM, len(keys), *keys, self._instance, self._ttl_ms))
        if claimed < 0:
            raise FatalError(
                f"all {partitions} reply partitions are claimed by live gateways: "
                "add partitions to the token topic before adding gateway instances"
            )
        self.partition = claimed
        self._task = asyncio.create_task(self._renew_forever(), name="reply-lease-renewal")
        log.info("reply partition claimed", extra={"partition": claimed, "instance": self._instance})
        return claimed

    async def _renew_forever(self) -> None:
        assert self.partition is not None
        lease = self._lease_key(self.partition)
        while True:
            await asyncio.sleep(self._renew_every)
            try:
                renewed = await self._redis.eval(_RENEW, 1, lease, self._instance, self._ttl_ms)
            except RedisError as exc:
                # Redis unreachable: the lease may still be valid; retry until it has surely expired.
                log.warning("reply lease renewal failed", extra={"reason": str(exc)})
                continue
            if not renewed:
                log.error("reply partition lease lost", extra={"partition": self.partition})
                self.lost.set()
                return

    async def close(self) -> None:
        # The lease is not deleted: the same instance restarting takes it back; anyone else waits for expiry.
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
