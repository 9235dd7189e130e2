"""Refusals before the expensive work (issue 37 M1): what a request costs the gateway before its admission.

Admission needs the prompt's token count (a request reserves prompt + max_tokens), so it comes after rendering and
tokenizing the prompt and, for a conversation's turn, reading its history and waiting for its previous turn. A
throttled or over-budget key must not buy that work with each refused request, so two things come first:

* **A refusal remembered.** A key (or org) refused for its requests per minute cannot be admitted before its bucket
  holds a request again, whatever another gateway does meanwhile (others only take from it): until then its
  requests are refused at once, with the same 429 and what is left of its wait, no Redis round trip. A budget
  refusal stands for a second. Either stands only while the key's org record is the one it was judged against: a
  raised budget or limit applies at once (the shared bucket refills at the new rate). A refusal for tokens depends
  on the request's size, one for requests in flight ends whenever a stream does, and one of this process's own
  limiter (Redis down) holds a bucket the fleet's limiter never saw, which may admit the key as soon as Redis is back:
  none is remembered.
* **A bound on the work in hand.** A key may have at most as many requests being prepared at once on this process
  as it may have in flight (``max_concurrent``): a flood of turns waiting for their previous turn, or of prompts
  being tokenized, is refused past it (429, ``requests``) instead of queueing work nobody can be admitted for.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from producers.gateway.errors import ApiError
from runtime.metrics import GATEWAY_EARLY_REFUSALS
from runtime.settings import TierTable
from runtime.tenancy import ApiKey, limits_for
from schemas.events import OrgRecord

#: how long a budget refusal stands while the org's record stays the same
BUDGET_MEMORY_S = 1.0
#: remembered refusals kept at most (the oldest go first): a memory, not a store
CAPACITY = 100_000


@dataclass(frozen=True)
class _Remembered:
    until: float
    error: ApiError
    #: the org record (limits, budget) it was judged against: void once the key's org is another record
    org: OrgRecord
    #: a requests-per-minute refusal: its wait counts down (a budget refusal has none)
    waits: bool


class EarlyRefusals:
    def __init__(self, tiers: TierTable, *, clock: Callable[[], float] = time.monotonic,
                 on_refused: Callable[[ApiKey], None] | None = None) -> None:
        self._tiers = tiers
        self._clock = clock
        #: told of each refusal made here, as the limiter's are (the abuse detector counts 429s)
        self._on_refused = on_refused
        self._refused: dict[str, _Remembered] = {}
        self._preparing: Counter[str] = Counter()

    def check(self, key: ApiKey) -> None:
        """Refuse at once what its limits cannot admit yet (a refusal remembered)."""
        now = self._clock()
        for who in (f"key:{key.key_id}", f"org:{key.org_id}"):
            remembered = self._refused.get(who)
            if remembered is None:
                continue
            if remembered.until <= now or remembered.org is not key.org:
                del self._refused[who]
                continue
            GATEWAY_EARLY_REFUSALS.labels(reason="remembered").inc()
            self._refused_now(key)
            raise _again(remembered, now)

    def remember(self, key: ApiKey, error: ApiError) -> None:
        """A refusal of ``key``'s admission: remembered when its wait is known (requests per minute, budget) and the
        shared limiter made it."""
        if getattr(error, "local", False):
            return
        limit, scope = getattr(error, "limit", None), getattr(error, "scope", None)
        who = f"org:{key.org_id}" if scope == "org" else f"key:{key.key_id}"
        now = self._clock()
        if limit == "requests":
            retry_ms = int((error.headers or {}).get("retry-after-ms", "-1"))
            if retry_ms <= 0:
                return
            self._refused[who] = _Remembered(now + retry_ms / 1000, error, key.org, waits=True)
        elif limit == "budget":
            self._refused[f"org:{key.org_id}"] = _Remembered(now + BUDGET_MEMORY_S, error, key.org, waits=False)
        else:
            return
        while len(self._refused) > CAPACITY:
            del self._refused[next(iter(self._refused))]

    @contextlib.contextmanager
    def preparing(self, key: ApiKey) -> Iterator[None]:
        """Around a request's work before its admission: at most ``max_concurrent`` of a key's at once here."""
        self.check(key)
        limit = limits_for(key.org, self._tiers).max_concurrent
        if self._preparing[key.key_id] >= limit:
            GATEWAY_EARLY_REFUSALS.labels(reason="preparing").inc()
            self._refused_now(key)
            raise ApiError(429, f"Rate limit reached for API key {key.key_id} on requests in flight: Limit {limit} "
                                "requests being prepared at once (a turn waiting for the previous one counts). "
                                "Please try again in 1s.", type="requests", code="rate_limit_exceeded",
                           headers={"retry-after": "1", "retry-after-ms": "1000"})
        self._preparing[key.key_id] += 1
        try:
            yield
        finally:
            self._preparing[key.key_id] -= 1
            if not self._preparing[key.key_id]:
                del self._preparing[key.key_id]


    def _refused_now(self, key: ApiKey) -> None:
        if self._on_refused is not None:
            self._on_refused(key)


def _again(remembered: _Remembered, now: float) -> ApiError:
    """The remembered refusal, its wait counted from now."""
    error = remembered.error
    headers = dict(error.headers or {})
    if remembered.waits:
        left_ms = max(1, math.ceil((remembered.until - now) * 1000))
        headers |= {"retry-after": str(max(1, math.ceil(left_ms / 1000))), "retry-after-ms": str(left_ms)}
    return ApiError(error.status, error.message, type=error.type, param=error.param, code=error.code,
                    headers=headers)
