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
lost) lapses after the reservation TTL. So ``billed`` is the ledger's sum and ``billed + reserved`` bounds what
billing will charge.

Nano-dollars, because a request to a small model costs a few micro-dollars: the price table's rates (dollars per
million tokens, to the cent) make every ledger cost a whole number of nano-dollars, so ``billed`` equals the
ledger's sum exactly (a finer rate would be rounded half up, per row). Redis counts them in 64-bit integers; the
admission script compares them as doubles, exact up to 2**53 nano-dollars ($9M a month per org).
"""

from __future__ import annotations

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
    """What admission checks a request against: its org's budget, and the most the request may cost."""

    month: str
    budget_nanos: int
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
        if self.billed_nanos >= budget * self.alert_fraction and self.threshold_alerted_for != budget:
            due.append("threshold")
        if self.billed_nanos >= budget and self.exhausted_alerted_for != budget:
            due.append("exhausted")
        return due


# KEYS: 1-3 the org-month's sum, holds, expiry; 4 the request's charge mark.
# ARGV: 1 request id, 2 cost nanos, 3 mark ttl s, 4 keep s.
# Returns {applied, billed, budget or -1, alert fraction, threshold alerted for or -1, exhausted alerted for or -1}.
_CHARGE = """
local applied = 0
if redis.call('SET', KEYS[4], ARGV[2], 'NX', 'EX', ARGV[3]) then
  applied = 1
  redis.call('HINCRBY', KEYS[1], 'billed', ARGV[2])
  local held = redis.call('HGET', KEYS[2], ARGV[1])
  if held then
    redis.call('HINCRBY', KEYS[1], 'reserved', -tonumber(held))
    redis.call('HDEL', KEYS[2], ARGV[1])
    redis.call('ZREM', KEYS[3], ARGV[1])
  end
  for i = 1, 3 do redis.call('EXPIRE', KEYS[i], ARGV[4]) end
end
local s = redis.call('HMGET', KEYS[1], 'billed', 'budget', 'frac', 'alerted_threshold', 'alerted_exhausted')
return {applied, s[1] or '0', s[2] or '-1', s[3] or '1', s[4] or '-1', s[5] or '-1'}
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

    def keys(self, org_id: str, month: str) -> SpendKeys:
        return spend_keys(self._settings, org_id, month)

    async def charge(self, request_id: str, org_id: str, requested_at: datetime, cost: Decimal) -> Charged:
        """Bill one request's ledger cost into its org-month (once per request id, however often called)."""
        keys = self.keys(org_id, month_of(requested_at))
        mark = redis_key(self._settings, "spend", "charged", request_id)
        answer = await self._charge(keys=[*keys.all(), mark],
                                    args=[request_id, to_nanos(cost), self._mark_ttl_s, KEEP_S])
        budget, threshold, exhausted = (int(answer[i]) for i in (2, 4, 5))
        return Charged(bool(int(answer[0])), int(answer[1]), None if budget < 0 else budget, float(answer[3]),
                       None if threshold < 0 else threshold, None if exhausted < 0 else exhausted)

    async def alerted(self, org_id: str, month: str, kind: str, budget_nanos: int) -> None:
        await self._mark_alerted(keys=[self.keys(org_id, month).total], args=[kind, budget_nanos])

    async def read(self, org_id: str, month: str) -> Spend:
        keys = self.keys(org_id, month)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hmget(keys.total, "billed", "reserved")
            pipe.hlen(keys.holds)
            (billed, reserved), holds = await pipe.execute()
        return Spend(int(billed or 0), int(reserved or 0), int(holds))

    async def set_billed(self, org_id: str, month: str, billed_nanos: int) -> None:
        """Reconcile's repair: make ``billed`` what the ledger says (after Redis lost its data)."""
        keys = self.keys(org_id, month)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hset(keys.total, "billed", billed_nanos)
            pipe.expire(keys.total, KEEP_S)
            await pipe.execute()
