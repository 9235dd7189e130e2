"""Rate limits that hold across every gateway process: requests per minute, tokens per minute and requests in
flight, per key and per org, in Redis.

Requests and tokens are token buckets: capacity = the per-minute limit, refilled continuously at limit/60 per
second (OpenAI's limits behave so: the ``x-ratelimit-reset-*`` headers say when the bucket is full again). One Lua
script checks all six limits and then debits all of them or none, so admission is exact however many gateways ask
at once (Redis runs one script at a time), costs O(1) per request (a sliding log would sum its entries), and uses
Redis's clock, not each gateway's. In-flight requests are a sorted set of leases (score: when the lease ends), so
a gateway that dies with requests in flight frees their slots when the leases end.

A request reserves its prompt tokens + max_tokens at admission; ``settle`` gives back what it did not use, once:
the reservation hash is deleted in the same script, so a second settlement of the same request is a no-op.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from redis.asyncio import Redis

from runtime.redis_client import key as redis_key
from runtime.settings import RedisSettings

# KEYS: 1-3 the key's requests bucket, tokens bucket, in-flight set; 4-6 the org's; 7 the reservation.
# ARGV: 1 request id, 2 tokens, 3 lease ms, 4-6 the key's rpm, tpm, max in flight, 7-9 the org's, 10 reservation ttl s
# Returns {1, requests remaining, requests reset ms, tokens remaining, tokens reset ms} or
#         {0, limit ('requests'|'tokens'|'concurrent'), scope ('key'|'org'), retry after ms (-1: never), limit}.
_ADMIT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local rid, cost, lease = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local function level(k, cap)
  local v = redis.call('HMGET', k, 'v', 't')
  if not v[1] then return cap end
  return math.min(cap, tonumber(v[1]) + (now - tonumber(v[2])) * cap / 60000)
end
local buckets = {
  {KEYS[1], tonumber(ARGV[4]), 1, 'requests', 'key'}, {KEYS[2], tonumber(ARGV[5]), cost, 'tokens', 'key'},
  {KEYS[4], tonumber(ARGV[7]), 1, 'requests', 'org'}, {KEYS[5], tonumber(ARGV[8]), cost, 'tokens', 'org'},
}
local levels = {}
for i, b in ipairs(buckets) do
  levels[i] = level(b[1], b[2])
  if levels[i] < b[3] then
    local wait = -1
    if b[3] <= b[2] then wait = math.ceil((b[3] - levels[i]) * 60000 / b[2]) end
    return {0, b[4], b[5], wait, b[2]}
  end
end
local flights = {{KEYS[3], tonumber(ARGV[6]), 'key'}, {KEYS[6], tonumber(ARGV[9]), 'org'}}
for _, f in ipairs(flights) do
  redis.call('ZREMRANGEBYSCORE', f[1], '-inf', now)
  if redis.call('ZCARD', f[1]) >= f[2] then return {0, 'concurrent', f[3], 1000, f[2]} end
end
for i, b in ipairs(buckets) do
  redis.call('HSET', b[1], 'v', tostring(levels[i] - b[3]), 't', now)
  redis.call('PEXPIRE', b[1], 120000)
end
for _, f in ipairs(flights) do
  redis.call('ZADD', f[1], now + lease, rid)
  redis.call('PEXPIRE', f[1], lease + 60000)
end
redis.call('HSET', KEYS[7], 'tokens', cost, 'tk', KEYS[2], 'to', KEYS[5], 'capk', ARGV[5], 'capo', ARGV[8],
           'fk', KEYS[3], 'fo', KEYS[6])
redis.call('EXPIRE', KEYS[7], ARGV[10])
local function tight(a, b) if levels[a] / buckets[a][2] <= levels[b] / buckets[b][2] then return a end return b end
local r, k = tight(1, 3), tight(2, 4)
local function reset(i) return math.ceil((buckets[i][2] - (levels[i] - buckets[i][3])) * 60000 / buckets[i][2]) end
return {1, math.floor(levels[r] - 1), reset(r), math.floor(levels[k] - cost), reset(k)}
"""

# KEYS: 1 the reservation, 2 the key's settled-token counter, 3 the org's. ARGV: 1 request id, 2 tokens used.
# Returns 1 when this call settled the reservation, 0 when there was none (settled already, or expired).
_SETTLE = """
local r = redis.call('HGETALL', KEYS[1])
if #r == 0 then return 0 end
local h = {}
for i = 1, #r, 2 do h[r[i]] = r[i + 1] end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local back = tonumber(h['tokens']) - tonumber(ARGV[2])
for _, pair in ipairs({{h['tk'], tonumber(h['capk'])}, {h['to'], tonumber(h['capo'])}}) do
  local v = redis.call('HMGET', pair[1], 'v', 't')
  if v[1] then
    local level = math.min(pair[2], tonumber(v[1]) + (now - tonumber(v[2])) * pair[2] / 60000)
    redis.call('HSET', pair[1], 'v', tostring(math.min(pair[2], level + back)), 't', now)
  end
end
redis.call('ZREM', h['fk'], ARGV[1])
redis.call('ZREM', h['fo'], ARGV[1])
redis.call('INCRBY', KEYS[2], ARGV[2])
redis.call('INCRBY', KEYS[3], ARGV[2])
redis.call('DEL', KEYS[1])
return 1
"""


@dataclass(frozen=True)
class Limits:
    requests_per_minute: int
    tokens_per_minute: int
    max_concurrent: int


@dataclass(frozen=True)
class Admitted:
    requests_limit: int
    requests_remaining: int
    requests_reset_ms: int
    tokens_limit: int
    tokens_remaining: int
    tokens_reset_ms: int

    def headers(self) -> dict[str, str]:
        """OpenAI's rate-limit headers."""
        return {
            "x-ratelimit-limit-requests": str(self.requests_limit),
            "x-ratelimit-remaining-requests": str(max(self.requests_remaining, 0)),
            "x-ratelimit-reset-requests": duration(self.requests_reset_ms),
            "x-ratelimit-limit-tokens": str(self.tokens_limit),
            "x-ratelimit-remaining-tokens": str(max(self.tokens_remaining, 0)),
            "x-ratelimit-reset-tokens": duration(self.tokens_reset_ms),
        }


@dataclass(frozen=True)
class Refused:
    limit: str  # requests | tokens | concurrent
    scope: str  # key | org
    retry_after_ms: int  # -1: never (the request alone exceeds the limit)
    value: int


def duration(ms: int) -> str:
    """OpenAI's format of a reset time: ``20ms``, ``1s``, ``6m0s``."""
    if ms < 1000:
        return f"{max(ms, 0)}ms"
    seconds = math.ceil(ms / 1000)
    minutes, seconds = divmod(seconds, 60)
    return f"{minutes}m{seconds}s" if minutes else f"{seconds}s"


class RateLimiter:
    def __init__(self, redis: Redis, settings: RedisSettings, *, lease_s: float, reservation_ttl_s: int) -> None:
        self._redis = redis
        self._settings = settings
        self._lease_ms = int(lease_s * 1000)
        self._ttl = reservation_ttl_s
        self._admit = redis.register_script(_ADMIT)
        self._settle = redis.register_script(_SETTLE)

    def _keys(self, scope: str, ident: str) -> list[str]:
        return [redis_key(self._settings, "rl", scope, ident, part) for part in ("requests", "tokens", "flight")]

    def _reservation(self, request_id: str) -> str:
        return redis_key(self._settings, "rl", "reservation", request_id)

    def settled_key(self, scope: str, ident: str) -> str:
        """Tokens settled for a key or org so far (what billing charged for the requests it admitted)."""
        return redis_key(self._settings, "rl", scope, ident, "settled")

    async def admit(self, request_id: str, tokens: int, *, key_id: str, org_id: str, key_limits: Limits,
                    org_limits: Limits) -> Admitted | Refused:
        keys = [*self._keys("key", key_id), *self._keys("org", org_id), self._reservation(request_id)]
        args: list[str | int] = [request_id, tokens, self._lease_ms,
                                 key_limits.requests_per_minute, key_limits.tokens_per_minute,
                                 key_limits.max_concurrent, org_limits.requests_per_minute,
                                 org_limits.tokens_per_minute, org_limits.max_concurrent, self._ttl]
        answer = [int(x) if str(x).lstrip("-").isdigit() else str(x) for x in await self._admit(keys=keys, args=args)]
        if answer[0] == 0:
            return Refused(str(answer[1]), str(answer[2]), int(answer[3]), int(answer[4]))
        return Admitted(min(key_limits.requests_per_minute, org_limits.requests_per_minute), int(answer[1]),
                        int(answer[2]), min(key_limits.tokens_per_minute, org_limits.tokens_per_minute),
                        int(answer[3]), int(answer[4]))

    async def settle(self, request_id: str, used_tokens: int, *, key_id: str, org_id: str) -> bool:
        """Give back what the request reserved and did not use; once (later calls return False)."""
        done = await self._settle(keys=[self._reservation(request_id), self.settled_key("key", key_id),
                                        self.settled_key("org", org_id)], args=[request_id, used_tokens])
        return bool(int(done))
