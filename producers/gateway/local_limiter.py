"""The limiter a gateway falls back to while Redis is unreachable: the same token buckets and in-flight counts as
``runtime.limiter.RateLimiter``, kept in this process only.

It cannot see the other gateways, so each admits ``tenancy.local_share`` of every limit (1/N for N gateways keeps
the sum at the limit). Its buckets are kept between outages (a Redis that comes and goes must not hand out full
buckets each time it goes); each refills as the shared one does. Nothing here awaits, so each admission is
atomic on the event loop.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from runtime.limiter import Admitted, Decision, Limits, ReadDecision, ReadWindow, Refused, Window
from runtime.spend import BudgetHold


@dataclass
class _Bucket:
    capacity: float
    level: float
    at: float

    def refill(self, now: float) -> float:
        self.level = min(self.capacity, self.level + (now - self.at) * self.capacity / 60.0)
        self.at = now
        return self.level

    def reset_ms(self, debit: float = 0.0) -> int:
        return max(0, math.ceil((self.capacity - (self.level - debit)) * 60_000 / self.capacity))


@dataclass
class _Reservation:
    tokens: int
    buckets: tuple[_Bucket, _Bucket]
    flights: tuple[set[str], set[str]]


@dataclass
class LocalLimiter:
    share: float = 1.0
    clock: Callable[[], float] = time.monotonic
    _buckets: dict[tuple[str, str, str], _Bucket] = field(default_factory=dict)
    _flights: dict[tuple[str, str], set[str]] = field(default_factory=dict)
    _reservations: dict[str, _Reservation] = field(default_factory=dict)

    def _now(self) -> float:
        return self.clock()

    def _scaled(self, value: int) -> int:
        return max(1, math.floor(value * self.share))

    def _bucket(self, scope: str, ident: str, kind: str, capacity: int, now: float) -> _Bucket:
        bucket = self._buckets.get((scope, ident, kind))
        if bucket is None or bucket.capacity != capacity:
            bucket = self._buckets[(scope, ident, kind)] = _Bucket(capacity, capacity, now)
        bucket.refill(now)
        return bucket

    async def admit(self, request_id: str, tokens: int, *, key_id: str, org_id: str, key_limits: Limits,
                    org_limits: Limits, budget: BudgetHold | None = None) -> Decision:
        # ``budget`` is not checked: an org's spend lives in Redis, which is down when this limiter decides.
        now = self._now()
        checks = []
        for scope, ident, limits in (("key", key_id, key_limits), ("org", org_id, org_limits)):
            checks.append((self._bucket(scope, ident, "requests", self._scaled(limits.requests_per_minute), now),
                           1, "requests", scope))
            checks.append((self._bucket(scope, ident, "tokens", self._scaled(limits.tokens_per_minute), now),
                           tokens, "tokens", scope))
        requests = min((c for c in checks if c[2] == "requests"), key=lambda c: c[0].level / c[0].capacity)[0]
        token_bucket = min((c for c in checks if c[2] == "tokens"), key=lambda c: c[0].level / c[0].capacity)[0]

        def window() -> Window:  # as the buckets stand when it is called (after the debit, when admitted)
            return Window(int(requests.capacity), math.floor(requests.level), requests.reset_ms(),
                          int(token_bucket.capacity), math.floor(token_bucket.level), token_bucket.reset_ms())

        for bucket, cost, limit, scope in checks:
            if bucket.level < cost:
                wait = math.ceil((cost - bucket.level) * 60_000 / bucket.capacity) if cost <= bucket.capacity else -1
                return Refused(limit, scope, wait, int(bucket.capacity), window())
        flights = (self._flights.setdefault(("key", key_id), set()), self._flights.setdefault(("org", org_id), set()))
        for flight, scope, limits in ((flights[0], "key", key_limits), (flights[1], "org", org_limits)):
            if len(flight) >= self._scaled(limits.max_concurrent):
                return Refused("concurrent", scope, 1000, self._scaled(limits.max_concurrent), window())
        for bucket, cost, _limit, _scope in checks:
            bucket.level -= cost
        for flight in flights:
            flight.add(request_id)
        own_tokens = (checks[1][0], checks[3][0])
        self._reservations[request_id] = _Reservation(tokens, own_tokens, flights)
        return Admitted(window())

    async def admit_read(self, *, key_id: str, org_id: str, key_reads: int, org_reads: int,
                         cost: int = 1) -> ReadDecision:
        now = self._now()
        buckets = [(self._bucket(scope, ident, "reads", self._scaled(reads), now), scope)
                   for scope, ident, reads in (("key", key_id, key_reads), ("org", org_id, org_reads))]
        tight = min(buckets, key=lambda b: b[0].level / b[0].capacity)[0]

        def window(debit: float) -> ReadWindow:
            return ReadWindow(int(tight.capacity), math.floor(tight.level - debit), tight.reset_ms(debit))

        for bucket, scope in buckets:
            # A read that costs more than this process's share of the bucket takes the whole of it: else it would
            # be refused for as long as Redis is down, each time told to come back
            need = min(cost, bucket.capacity)
            if bucket.level < need:
                wait = math.ceil((need - bucket.level) * 60_000 / bucket.capacity)
                return ReadDecision(False, window(0), scope, wait, int(bucket.capacity))
        for bucket, _scope in buckets:
            bucket.level -= min(cost, bucket.capacity)
        return ReadDecision(True, window(0))

    async def release(self, request_id: str, *, key_id: str, org_id: str) -> None:
        for scope, ident in (("key", key_id), ("org", org_id)):
            self._flights.get((scope, ident), set()).discard(request_id)

    async def settle(self, request_id: str, used_tokens: int, *, billed: bool = False) -> bool:
        reservation = self._reservations.pop(request_id, None)
        if reservation is None:
            return False
        now = self._now()
        for bucket in reservation.buckets:
            bucket.level = min(bucket.capacity, bucket.refill(now) + reservation.tokens - used_tokens)
        for flight in reservation.flights:
            flight.discard(request_id)
        return True
