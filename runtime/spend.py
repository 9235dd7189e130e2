"""An org's monthly spend in Redis, kept equal to what billing charges: the ledger's cost of its billed requests
plus what the requests still in flight may cost at most.

Per org and calendar month (UTC, of the request's creation) three keys:

* ``…:sum`` (hash): ``billed`` and ``reserved`` nano-dollars, the ``budget`` the org's last admission carried and
  its alert fraction, and the budgets for which the threshold and exhaustion alerts were already raised;
* ``…:holds`` (hash): request id → its hold (nano-dollars), and ``…:expiry`` (sorted set): when each hold lapses.

A gateway's admission (the rate limiter's script, ``runtime/limiter.py``) refuses a request whose hold would take
``billed + reserved`` past the budget, else adds its hold, in the same script as the rate limits: all or nothing.
The billing processor, once the ledger has the request's row, *charges* it: the row's cost is added to ``billed``
and the request's hold removed from ``reserved``, in one script made idempotent by a per-request mark, so a
redelivered usage event never counts twice. A request that ends unbilled (refused by the safety filter, past its
queue deadline, never produced) has its hold dropped by whoever settles it. A hold nobody ended (its request was
lost) lapses after the reservation TTL; the hold of a request its worker settled as billed does not lapse: it
waits for billing's charge however late that comes (a dead-lettered usage event keeps it until an operator's
repair bills it). So ``billed`` is the ledger's sum and ``billed + reserved`` bounds what billing will charge.
Every admission records the org's current budget (or its absence) in ``…:sum``, refused ones included, so the
alerts a charge raises are judged against the budget in force.

After Redis lost its data, ``kns billing spend --repair`` charges every ledger row of the month again: the marks
make that safe while billing runs (a row charged twice is counted once), and it restores the marks a redelivery
needs. Reconcile's repair charges what it bills (a corrected row's cost replaces what was charged for it).

Nano-dollars, because a request to a small model costs a few micro-dollars: the price table's rates (dollars per
million tokens, to the cent) make every ledger cost a whole number of nano-dollars, so ``billed`` equals the
ledger's sum exactly (a finer rate would be rounded half up, per row). Redis counts them in 64-bit integers; the
admission script compares them as doubles, exact up to 2**53 nano-dollars ($9M a month per org).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import ROUND_HALF_UP, Decimal

from redis.asyncio import Redis

from runtime.redis_client import key as redis_key
from runtime.settings import RedisSettings

NANOS = Decimal(1_000_000_000)
MICROS_PER_NANO = 1000
#: the spend keys outlive their month by this much (a late usage event still finds them)
KEEP_S = 40 * 24 * 3600


def to_nanos(usd: Decimal) -> int:
    return int((usd * NANOS).to_integral_value(rounding=ROUND_HALF_UP))


def usd(nanos: int) -> Decimal:
    return Decimal(nanos) / NANOS


def ledger_nanos(costs: Iterable[Decimal]) -> int:
    """The ledger's sum as the spend counts it: each row's cost rounded to the nano-dollar (half up), then added."""
    return sum(to_nanos(cost) for cost in costs)


def nanos_of_micros(micros: int) -> int:
    """An org's budget (kept in micro-dollars in the registry) in the spend's unit."""
    return micros * MICROS_PER_NANO


def month_of(at: datetime) -> str:
    return at.astimezone(UTC).strftime("%Y-%m")


@dataclass(frozen=True)
class SpendKeys:
    total: str
    holds: str
    expiry: str

    def all(self) -> list[str]:
        return [self.total, self.holds, self.expiry]


def spend_keys(settings: RedisSettings, org_id: str, month: str) -> SpendKeys:
    base = ("spend", org_id, month)
    return SpendKeys(redis_key(settings, *base, "sum"), redis_key(settings, *base, "holds"),
                     redis_key(settings, *base, "expiry"))


@dataclass(frozen=True)
class BudgetHold:
    """What admission checks a request against: its org's budget (None: it has none, and keeps no hold), and the
    most the request may cost."""

    month: str
    budget_nanos: int | None
    hold_nanos: int
    alert_fraction: float


@dataclass(frozen=True)
class Charged:
    """An org-month after a charge: what it was billed, and which budget alerts are due."""

    applied: bool
    billed_nanos: int
    budget_nanos: int | None
    alert_fraction: float
    #: the budget for which each alert was last raised (None: never)
    threshold_alerted_for: int | None
    exhausted_alerted_for: int | None

    def due(self) -> list[str]:
        """The alerts this org-month owes: ``threshold`` (billed crossed the alert fraction of the budget) and
        ``exhausted`` (billed reached the budget), each once per budget value."""
        budget = self.budget_nanos
        if budget is None:
            return []
        due = []
        threshold = Decimal(budget) * Decimal(str(self.alert_fraction))  # exact: no float rounding at the line
        if self.billed_nanos >= threshold and self.threshold_alerted_for != budget:
            due.append("threshold")
        if self.billed_nanos >= budget and self.exhausted_alerted_for != budget:
            due.append("exhausted")
        return due


#: Lua: end the holds of ``sum``/``holds``/``expiry`` whose time is up (at most ``limit`` of them)
SWEEP = """
local function sweep(sum, holds, expiry, now, limit)
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', expiry, '-inf', now, 'LIMIT', 0, limit)) do
    local held = redis.call('HGET', holds, id)
    if held then redis.call('HINCRBY', sum, 'reserved', -tonumber(held)) end
    redis.call('HDEL', holds, id)
    redis.call('ZREM', expiry, id)
  end
end
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
"""

# KEYS: 1-3 the org-month's sum, holds, expiry; 4 the request's charge mark.
# ARGV: 1 request id, 2 cost nanos, 3 mark ttl s, 4 keep s, 5 '1': a correction (the cost replaces the one charged).
# Returns {applied, billed, budget or -1, alert fraction, threshold alerted for or -1, exhausted alerted for or -1}.
_CHARGE = SWEEP + """
local applied = 0
local before = redis.call('GET', KEYS[4])
if not before then
  applied = 1
  redis.call('SET', KEYS[4], ARGV[2], 'EX', ARGV[3])
  redis.call('HINCRBY', KEYS[1], 'billed', ARGV[2])
  local held = redis.call('HGET', KEYS[2], ARGV[1])
  if held then
    redis.call('HINCRBY', KEYS[1], 'reserved', -tonumber(held))
    redis.call('HDEL', KEYS[2], ARGV[1])
    redis.call('ZREM', KEYS[3], ARGV[1])
  end
elseif ARGV[5] == '1' and before ~= ARGV[2] then
  applied = 1
  redis.call('SET', KEYS[4], ARGV[2], 'EX', ARGV[3])
  redis.call('HINCRBY', KEYS[1], 'billed', tonumber(ARGV[2]) - tonumber(before))
end
sweep(KEYS[1], KEYS[2], KEYS[3], now_ms(), 16)
if applied == 1 then for i = 1, 3 do redis.call('EXPIRE', KEYS[i], ARGV[4]) end end
local s = redis.call('HMGET', KEYS[1], 'billed', 'budget', 'frac', 'alerted_threshold', 'alerted_exhausted')
return {applied, s[1] or '0', s[2] or '-1', s[3] or '1', s[4] or '-1', s[5] or '-1'}
"""

# KEYS: the org-month's sum, holds, expiry. Returns {billed, reserved, holds} after ending the holds whose time is up.
_READ = SWEEP + """
sweep(KEYS[1], KEYS[2], KEYS[3], now_ms(), 10000)
local s = redis.call('HMGET', KEYS[1], 'billed', 'reserved')
return {s[1] or '0', s[2] or '0', redis.call('HLEN', KEYS[2])}
"""

_MARK_ALERTED = """
if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('HSET', KEYS[1], 'alerted_' .. ARGV[1], ARGV[2]) end
return 1
"""


@dataclass(frozen=True)
class Spend:
    billed_nanos: int
    reserved_nanos: int
    holds: int


class SpendBook:
    """The spend side the billing processor and operators use (admission's side is in the limiter's script)."""

    def __init__(self, redis: Redis, settings: RedisSettings, *, mark_ttl_s: int = KEEP_S) -> None:
        self._redis = redis
        self._settings = settings
        self._mark_ttl_s = mark_ttl_s
        self._charge = redis.register_script(_CHARGE)
        self._mark_alerted = redis.register_script(_MARK_ALERTED)
        self._read = redis.register_script(_READ)

    def keys(self, org_id: str, month: str) -> SpendKeys:
        return spend_keys(self._settings, org_id, month)

    async def charge(self, request_id: str, org_id: str, requested_at: datetime, cost: Decimal, *,
                     correction: bool = False) -> Charged:
        """Bill one request's ledger cost into its org-month, once per request id however often called (a
        ``correction``, reconcile's repair of a row's cost, replaces what was charged for it)."""
        keys = self.keys(org_id, month_of(requested_at))
        mark = redis_key(self._settings, "spend", "charged", request_id)
        answer = await self._charge(keys=[*keys.all(), mark],
                                    args=[request_id, to_nanos(cost), self._mark_ttl_s, KEEP_S, int(correction)])
        budget, threshold, exhausted = (int(answer[i]) for i in (2, 4, 5))
        return Charged(bool(int(answer[0])), int(answer[1]), None if budget < 0 else budget, float(answer[3]),
                       None if threshold < 0 else threshold, None if exhausted < 0 else exhausted)

    async def charge_all(self, rows: Iterable[tuple[str, str, datetime, Decimal]], chunk: int = 500) -> int:
        """Charge many (request id, org, requested at, cost) in pipelines; how many were not charged before."""
        rows = list(rows)
        applied = 0
        for i in range(0, len(rows), chunk):
            async with self._redis.pipeline(transaction=False) as pipe:
                for request_id, org_id, at, cost in rows[i:i + chunk]:
                    keys = self.keys(org_id, month_of(at))
                    mark = redis_key(self._settings, "spend", "charged", request_id)
                    await self._charge(keys=[*keys.all(), mark],
                                       args=[request_id, to_nanos(cost), self._mark_ttl_s, KEEP_S, 0], client=pipe)
                applied += sum(int(answer[0]) for answer in await pipe.execute())
        return applied

    async def alerted(self, org_id: str, month: str, kind: str, budget_nanos: int) -> None:
        await self._mark_alerted(keys=[self.keys(org_id, month).total], args=[kind, budget_nanos])

    async def read(self, org_id: str, month: str) -> Spend:
        """The org-month's spend, once the holds whose time is up have ended."""
        billed, reserved, holds = await self._read(keys=self.keys(org_id, month).all())
        return Spend(int(billed), int(reserved), int(holds))
