"""Rate limits that hold across every gateway process: requests per minute, tokens per minute and requests in
flight, per key and per org, in Redis; and reads per minute (list reads and resumes), a bucket of their own.

Requests and tokens are token buckets: capacity = the per-minute limit, refilled continuously at limit/60 per
second (OpenAI's limits behave so: the ``x-ratelimit-reset-*`` headers say when the bucket is full again). One Lua
script checks all six limits and then debits all of them or none, so admission is exact however many gateways ask
at once (Redis runs one script at a time), costs O(1) per request (a sliding log would sum its entries), and uses
Redis's clock, not each gateway's. In-flight requests are a sorted set of leases (score: when the lease ends), so
a gateway that dies with requests in flight frees their slots when the leases end.

A request reserves its prompt tokens + max_tokens at admission; ``settle`` gives back what it did not use, once:
the reservation hash is deleted in the same script, so a second settlement of the same request is a no-op. The
worker that commits a request's final settles it with the usage it billed (0 when nothing was billed), after the
commit: a fenced zombie never settles, a takeover's commit does, and the settled counters add up to the ledger.
The gateway frees the in-flight slots as soon as its client's answer ends (``release``); a request that never
reached Kafka is settled by the gateway with 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from redis.asyncio import Redis

from runtime.redis_client import key as redis_key
from runtime.settings import RedisSettings
from runtime.spend import KEEP_S, SWEEP, BudgetHold, spend_keys

# KEYS: 1-3 the key's requests bucket, tokens bucket, in-flight set; 4-6 the org's; 7 the reservation;
#       8-9 the key's and the org's settled-token counters (kept in the reservation for whoever settles it);
#       10-12 the org-month's spend sum, holds and hold expiries (runtime/spend.py).
# ARGV: 1 request id, 2 tokens, 3 lease ms, 4-6 the key's rpm, tpm, max in flight, 7-9 the org's, 10 reservation ttl s,
#       11 the org's monthly budget in nano-dollars (-1: none), 12 the request's hold, 13 the alert fraction,
#       14 how long the spend keys are kept (s).
# Returns {1, requests remaining, requests reset ms, tokens remaining, tokens reset ms} or
#         {0, requests remaining, requests reset ms, tokens remaining, tokens reset ms,
#          limit ('budget'|'requests'|'tokens'|'concurrent'), scope ('key'|'org'), retry after ms (-1: never),
#          limit value}.
_ADMIT = SWEEP + """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local rid, cost, lease = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local budget, hold = tonumber(ARGV[11]), tonumber(ARGV[12])
local buckets = {
  {KEYS[1], tonumber(ARGV[4]), 1, 'requests', 'key'}, {KEYS[2], tonumber(ARGV[5]), cost, 'tokens', 'key'},
  {KEYS[4], tonumber(ARGV[7]), 1, 'requests', 'org'}, {KEYS[5], tonumber(ARGV[8]), cost, 'tokens', 'org'},
}
local levels = {}
for i, b in ipairs(buckets) do
  local v = redis.call('HMGET', b[1], 'v', 't')
  if v[1] then levels[i] = math.min(b[2], tonumber(v[1]) + (now - tonumber(v[2])) * b[2] / 60000)
  else levels[i] = b[2] end
end
-- the headers describe the tighter of key and org (OpenAI's describe one limit per kind)
local function tight(a, b) if levels[a] / buckets[a][2] <= levels[b] / buckets[b][2] then return a end return b end
local r, k = tight(1, 3), tight(2, 4)
local function reset(i, debit)
  return math.max(0, math.ceil((buckets[i][2] - (levels[i] - debit)) * 60000 / buckets[i][2]))
end
local function refuse(limit, scope, wait, value)
  return {0, math.floor(levels[r]), reset(r, 0), math.floor(levels[k]), reset(k, 0), limit, scope, wait, value}
end
if budget >= 0 then
  -- the budget in force, for the alerts billing judges (a refused admission records a lowered one too)
  redis.call('HSET', KEYS[10], 'budget', ARGV[11], 'frac', ARGV[13])
  redis.call('EXPIRE', KEYS[10], ARGV[14])
  -- holds nobody ended (their requests were lost) lapse; a few per admission keeps this O(1)
  sweep(KEYS[10], KEYS[11], KEYS[12], now, 16)
  local s = redis.call('HMGET', KEYS[10], 'billed', 'reserved')
  if (tonumber(s[1]) or 0) + (tonumber(s[2]) or 0) + hold > budget then return refuse('budget', 'org', -1, budget) end
end
for i, b in ipairs(buckets) do
  if levels[i] < b[3] then
    local wait = -1
    if b[3] <= b[2] then wait = math.ceil((b[3] - levels[i]) * 60000 / b[2]) end
    return refuse(b[4], b[5], wait, b[2])
  end
end
local flights = {{KEYS[3], tonumber(ARGV[6]), 'key'}, {KEYS[6], tonumber(ARGV[9]), 'org'}}
for _, f in ipairs(flights) do
  redis.call('ZREMRANGEBYSCORE', f[1], '-inf', now)
  if redis.call('ZCARD', f[1]) >= f[2] then return refuse('concurrent', f[3], 1000, f[2]) end
end
for i, b in ipairs(buckets) do
  redis.call('HSET', b[1], 'v', string.format('%.17g', levels[i] - b[3]), 't', now)
  redis.call('PEXPIRE', b[1], 120000)
end
for _, f in ipairs(flights) do
  redis.call('ZADD', f[1], now + lease, rid)
  redis.call('PEXPIRE', f[1], lease + 60000)
end
redis.call('HSET', KEYS[7], 'tokens', cost, 'tk', KEYS[2], 'to', KEYS[5], 'capk', ARGV[5], 'capo', ARGV[8],
           'fk', KEYS[3], 'fo', KEYS[6], 'sk', KEYS[8], 'so', KEYS[9])
redis.call('EXPIRE', KEYS[7], ARGV[10])
if budget < 0 then
  redis.call('HDEL', KEYS[10], 'budget', 'frac')  -- no budget (any more): no budget alerts
else
  redis.call('HINCRBY', KEYS[10], 'reserved', hold)
  redis.call('HSET', KEYS[11], rid, hold)
  redis.call('ZADD', KEYS[12], now + tonumber(ARGV[10]) * 1000, rid)
  for i = 10, 12 do redis.call('EXPIRE', KEYS[i], ARGV[14]) end
  redis.call('HSET', KEYS[7], 'bs', KEYS[10], 'bh', KEYS[11], 'be', KEYS[12])
end
return {1, math.floor(levels[r] - 1), reset(r, 1), math.floor(levels[k] - cost), reset(k, cost)}
"""

# KEYS: 1-2 the key's and the org's read buckets. ARGV: 1-2 their reads per minute, 3 the reads this one takes.
# Returns {1, reads remaining, reset ms} or {0, reads remaining, reset ms, scope ('key'|'org'), retry after ms,
#          limit value}: the remaining and reset of the tighter bucket.
_READ = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local buckets = {{KEYS[1], tonumber(ARGV[1]), 'key'}, {KEYS[2], tonumber(ARGV[2]), 'org'}}
local cost = tonumber(ARGV[3] or '1')
local levels = {}
for i, b in ipairs(buckets) do
  local v = redis.call('HMGET', b[1], 'v', 't')
  if v[1] then levels[i] = math.min(b[2], tonumber(v[1]) + (now - tonumber(v[2])) * b[2] / 60000)
  else levels[i] = b[2] end
end
local r = 2
if levels[1] / buckets[1][2] <= levels[2] / buckets[2][2] then r = 1 end
local function reset(debit)
  return math.max(0, math.ceil((buckets[r][2] - (levels[r] - debit)) * 60000 / buckets[r][2]))
end
for i, b in ipairs(buckets) do
  if levels[i] < cost then
    return {0, math.floor(levels[r]), reset(0), b[3], math.ceil((cost - levels[i]) * 60000 / b[2]), b[2]}
  end
end
for i, b in ipairs(buckets) do
  redis.call('HSET', b[1], 'v', string.format('%.17g', levels[i] - cost), 't', now)
  redis.call('PEXPIRE', b[1], 120000)
end
return {1, math.floor(levels[r] - cost), reset(cost)}
"""

# KEYS: 1 the reservation. ARGV: 1 request id, 2 tokens used, 3 '1' when the request was billed (its budget hold is
# then the billing processor's to end, with its cost), else '0' (the hold is dropped here).
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
    redis.call('HSET', pair[1], 'v', string.format('%.17g', math.min(pair[2], level + back)), 't', now)
  end
end
redis.call('ZREM', h['fk'], ARGV[1])
redis.call('ZREM', h['fo'], ARGV[1])
redis.call('INCRBY', h['sk'], ARGV[2])
redis.call('INCRBY', h['so'], ARGV[2])
if h['bs'] and ARGV[3] == '0' then
  local held = redis.call('HGET', h['bh'], ARGV[1])
  if held then redis.call('HINCRBY', h['bs'], 'reserved', -tonumber(held)) end
  redis.call('HDEL', h['bh'], ARGV[1])
  redis.call('ZREM', h['be'], ARGV[1])
elseif h['bs'] then
  -- billed: the hold is no longer a lost request's; it lasts until billing charges the cost
  redis.call('ZREM', h['be'], ARGV[1])
end
redis.call('DEL', KEYS[1])
return 1
"""


@dataclass(frozen=True)
class Limits:
    requests_per_minute: int
    tokens_per_minute: int
    max_concurrent: int


@dataclass(frozen=True)
class Window:
    """Where the tighter of the key's and the org's buckets stand: what OpenAI's rate-limit headers say."""

    requests_limit: int
    requests_remaining: int
    requests_reset_ms: int
    tokens_limit: int
    tokens_remaining: int
    tokens_reset_ms: int

    def headers(self) -> dict[str, str]:
        return {
            "x-ratelimit-limit-requests": str(self.requests_limit),
            "x-ratelimit-remaining-requests": str(max(self.requests_remaining, 0)),
            "x-ratelimit-reset-requests": duration(self.requests_reset_ms),
            "x-ratelimit-limit-tokens": str(self.tokens_limit),
            "x-ratelimit-remaining-tokens": str(max(self.tokens_remaining, 0)),
            "x-ratelimit-reset-tokens": duration(self.tokens_reset_ms),
        }


@dataclass(frozen=True)
class Admitted:
    window: Window

    def headers(self) -> dict[str, str]:
        return self.window.headers()


@dataclass(frozen=True)
class Refused:
    limit: str  # budget | requests | tokens | concurrent
    scope: str  # key | org
    retry_after_ms: int  # -1: never (the request alone exceeds the limit)
    value: int
    window: Window

    def headers(self) -> dict[str, str]:
        return self.window.headers()


Decision = Admitted | Refused


@dataclass(frozen=True)
class ReadWindow:
    """Where the tighter of the key's and the org's read buckets stands (a list read or a resume takes one read)."""

    limit: int
    remaining: int
    reset_ms: int

    def headers(self) -> dict[str, str]:
        # OpenAI's names: a read endpoint's requests are its reads
        return {"x-ratelimit-limit-requests": str(self.limit),
                "x-ratelimit-remaining-requests": str(max(self.remaining, 0)),
                "x-ratelimit-reset-requests": duration(self.reset_ms)}


@dataclass(frozen=True)
class ReadDecision:
    admitted: bool
    window: ReadWindow
    #: refused: whose bucket was empty ('key' | 'org'), when it holds a read again, and its limit
    scope: str = ""
    retry_after_ms: int = 0
    value: int = 0
#: (request id, tokens used, billed)
Settlement = tuple[str, int, bool]


class Limiter(Protocol):
    """Admission against a key's and its org's limits, and the end of what was admitted."""

    async def admit(self, request_id: str, tokens: int, *, key_id: str, org_id: str, key_limits: Limits,
                    org_limits: Limits, budget: BudgetHold | None = None) -> Decision: ...

    async def admit_read(self, *, key_id: str, org_id: str, key_reads: int, org_reads: int,
                         cost: int = 1) -> ReadDecision:
        """One read (a list read or a resume) against the key's and the org's read buckets (``*_reads`` per
        minute); a bucket apart from the requests': reads never take what generation may use, nor the reverse.
        ``cost``: the reads it takes (a usage report takes one per week of its range; at most a bucket's size)."""
        ...

    async def release(self, request_id: str, *, key_id: str, org_id: str) -> None:
        """The request is over for its client: its in-flight slots are free (its tokens are settled later)."""
        ...

    async def settle(self, request_id: str, used_tokens: int, *, billed: bool = False) -> bool:
        """Give back what the request reserved and did not use; once (later calls return False). Unbilled, its
        budget hold goes too; billed, the billing processor ends the hold when it charges the cost."""
        ...


def duration(ms: int) -> str:
    """OpenAI's format of a reset time: ``20ms``, ``1s``, ``6m0s``."""
    if ms < 1000:
        return f"{max(ms, 0)}ms"
    seconds = math.ceil(ms / 1000)
    minutes, seconds = divmod(seconds, 60)
    return f"{minutes}m{seconds}s" if minutes else f"{seconds}s"


class RateLimiter:
    """The limiter every gateway shares (Redis); workers settle with it what they finalized."""

    def __init__(self, redis: Redis, settings: RedisSettings, *, lease_s: float = 900.0,
                 reservation_ttl_s: int = 3600) -> None:
        self._redis = redis
        self._settings = settings
        self._lease_ms = int(lease_s * 1000)
        self._ttl = reservation_ttl_s
        self._admit = redis.register_script(_ADMIT)
        self._settle = redis.register_script(_SETTLE)
        self._read = redis.register_script(_READ)

    def _keys(self, scope: str, ident: str) -> list[str]:
        return [redis_key(self._settings, "rl", scope, ident, part) for part in ("requests", "tokens", "flight")]

    def _reservation(self, request_id: str) -> str:
        return redis_key(self._settings, "rl", "reservation", request_id)

    def settled_key(self, scope: str, ident: str) -> str:
        """Tokens settled for a key or org so far (what billing charged for the requests it admitted)."""
        return redis_key(self._settings, "rl", scope, ident, "settled")

    async def admit(self, request_id: str, tokens: int, *, key_id: str, org_id: str, key_limits: Limits,
                    org_limits: Limits, budget: BudgetHold | None = None) -> Decision:
        spend = spend_keys(self._settings, org_id, budget.month if budget else "-")
        keys = [*self._keys("key", key_id), *self._keys("org", org_id), self._reservation(request_id),
                self.settled_key("key", key_id), self.settled_key("org", org_id), *spend.all()]
        args: list[str | int | float] = [
            request_id, tokens, self._lease_ms, key_limits.requests_per_minute, key_limits.tokens_per_minute,
            key_limits.max_concurrent, org_limits.requests_per_minute, org_limits.tokens_per_minute,
            org_limits.max_concurrent, self._ttl,
            budget.budget_nanos if budget and budget.budget_nanos is not None else -1,
            budget.hold_nanos if budget else 0,
            budget.alert_fraction if budget else 1, KEEP_S]
        answer = await self._admit(keys=keys, args=args)
        window = Window(min(key_limits.requests_per_minute, org_limits.requests_per_minute), int(answer[1]),
                        int(answer[2]), min(key_limits.tokens_per_minute, org_limits.tokens_per_minute),
                        int(answer[3]), int(answer[4]))
        if int(answer[0]) == 0:
            return Refused(_text(answer[5]), _text(answer[6]), int(answer[7]), int(answer[8]), window)
        return Admitted(window)

    async def admit_read(self, *, key_id: str, org_id: str, key_reads: int, org_reads: int,
                         cost: int = 1) -> ReadDecision:
        keys = [redis_key(self._settings, "rl", scope, ident, "reads") for scope, ident in (("key", key_id),
                                                                                             ("org", org_id))]
        answer = await self._read(keys=keys, args=[key_reads, org_reads, cost])
        window = ReadWindow(min(key_reads, org_reads), int(answer[1]), int(answer[2]))
        if int(answer[0]) == 0:
            return ReadDecision(False, window, _text(answer[3]), int(answer[4]), int(answer[5]))
        return ReadDecision(True, window)

    async def release(self, request_id: str, *, key_id: str, org_id: str) -> None:
        flights = [self._keys(scope, ident)[2] for scope, ident in (("key", key_id), ("org", org_id))]
        async with self._redis.pipeline(transaction=False) as pipe:
            for flight in flights:
                pipe.zrem(flight, request_id)
            await pipe.execute()

    async def settle(self, request_id: str, used_tokens: int, *, billed: bool = False) -> bool:
        return bool(int(await self._settle(keys=[self._reservation(request_id)],
                                           args=[request_id, used_tokens, int(billed)])))

    async def settle_many(self, used: list[Settlement]) -> int:
        """Settle several requests in one round trip; how many this call settled."""
        if not used:
            return 0
        async with self._redis.pipeline(transaction=False) as pipe:
            for request_id, tokens, billed in used:
                await self._settle(keys=[self._reservation(request_id)], args=[request_id, tokens, int(billed)],
                                   client=pipe)
            return sum(int(x) for x in await pipe.execute())


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
