"""The reply-partition claim: which partition of the token topic this gateway instance tails, and its liveness.

A claim is a Redis lease (``SET NX PX``) per partition, renewed while the gateway lives, so live gateways
spread over the partitions. Each instance also remembers its "home" partition (no expiry): a restarted instance
takes its home back when it is free, so a claim survives a restart of the same instance.

The lease only spreads the load: two gateways tailing one partition would still each route only the requests
they registered. So losing it never stops a gateway (a Redis restart without persistence loses every lease at
once; stopping every gateway then would take the API down): a missing lease is taken again, one held by
another instance is logged and counted, and the gateway keeps serving either way.

Each renewal also refreshes the process's liveness key (``gateway_id`` = instance/incarnation): workers cancel
generations whose gateway process is gone (``inference_workers/presence.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets

from redis.asyncio import Redis
from redis.exceptions import RedisError

from runtime.metrics import GATEWAY_LEASE
from runtime.redis_client import gateway_alive_key, key
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

# KEYS[1]: the lease, KEYS[2]: the liveness key. ARGV: instance, lease ttl_ms, liveness ttl_ms.
# 1: held; 0: another instance holds it.
_RENEW = """
redis.call('SET', KEYS[2], '1', 'PX', ARGV[3])
local owner = redis.call('GET', KEYS[1])
if owner == ARGV[1] or not owner then redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2]) return 1 end
return 0
"""


class ReplyPartitionClaim:
    def __init__(self, redis: Redis, redis_settings: RedisSettings, gateway: GatewaySettings, topic: str) -> None:
        self._redis = redis
        self._instance = gateway.instance_id
        #: this process: a restarted instance is another process, whose predecessor's streams nobody receives
        self.gateway_id = f"{gateway.instance_id}/{secrets.token_hex(4)}"
        self._ttl_ms = int(gateway.reply_lease_ttl_s * 1000)
        self._alive_ms = int(gateway.liveness_ttl_s * 1000)
        self._renew_every = gateway.reply_lease_renew_s
        self._lease_key = lambda p: key(redis_settings, "reply-lease", topic, p)
        self._home_key = key(redis_settings, "reply-home", topic, self._instance)
        self._alive_key = gateway_alive_key(redis_settings, self.gateway_id)
        self.partition: int | None = None
        #: another instance holds this gateway's partition (after a Redis data loss): serving goes on, shared
        self.shared = False
        #: the last renewal failed (Redis unreachable)
        self.unconfirmed = False
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
        await self.renew()
        self._task = asyncio.create_task(self._renew_forever(), name="reply-lease-renewal")
        log.info("reply partition claimed", extra={"partition": claimed, "instance": self._instance,
                                                   "gateway_id": self.gateway_id})
        return claimed

    async def renew(self) -> None:
        assert self.partition is not None
        try:
            held = await self._redis.eval(_RENEW, 2, self._lease_key(self.partition), self._alive_key,
                                          self._instance, self._ttl_ms, self._alive_ms)
        except (RedisError, OSError, TimeoutError) as exc:
            # The lease may still be valid; either way the relay goes on tailing its partition.
            if not self.unconfirmed:
                log.warning("reply lease renewal failed", extra={"reason": repr(exc)})
            self.unconfirmed = True
            GATEWAY_LEASE.labels(state="unconfirmed").inc()
            return
        self.unconfirmed = False
        if not held and not self.shared:
            log.error("another gateway instance holds this gateway's reply partition; both serve it",
                      extra={"partition": self.partition})
        self.shared = not held
        GATEWAY_LEASE.labels(state="shared" if self.shared else "held").inc()

    async def _renew_forever(self) -> None:
        while True:
            await asyncio.sleep(self._renew_every)
            await self.renew()

    async def close(self) -> None:
        # The lease is not deleted: the same instance restarting takes it back; anyone else waits for expiry.
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            await self._redis.delete(self._alive_key)  # gone now: workers need not wait for the key to expire
