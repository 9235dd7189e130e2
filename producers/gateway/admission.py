"""Admission: a caller's request against its key's and its org's limits, before anything is produced.

The limits are the org's tier's (``tenancy.tiers``), each overridden by the org's own where it has one, and apply
alike to the key and to the org (the org's cap every key shares). The shared limiter (Redis) decides; while it is
unreachable the tier's ``when_redis_down`` policy does: ``closed`` answers 503, ``local`` admits against this
process's own limiter (``local_limiter.py``). A refusal is 429 ``rate_limit_exceeded`` in OpenAI's words, with
``Retry-After`` (and ``retry-after-ms``, which the openai SDK prefers) and the ``x-ratelimit-*`` headers.

An org with a monthly budget has each request's budget hold (``budget.py``) checked in the same script: a request
that could take the org's spend past its budget is 429 ``insufficient_quota``, as OpenAI answers a spent quota
(no Retry-After: waiting does not help; raising the budget does, at once). The local limiter cannot see the spend:
with Redis down, budgets are not enforced for tiers served locally.

List reads and stream resumes are admitted apart (``admit_read``): a read bucket per key and per org, as many reads
a minute as the org's requests, refused with the same 429 and headers.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from producers.gateway.budget import HoldPricer
from producers.gateway.errors import ApiError, unavailable
from producers.gateway.local_limiter import LocalLimiter
from runtime.limiter import Admitted, Limiter, ReadDecision, ReadWindow, Refused, Window
from runtime.metrics import LIMITER_DECISIONS, LIMITER_REDIS_DOWN, LIMITER_SECONDS
from runtime.settings import TierTable
from runtime.spend import BudgetHold
from runtime.tenancy import ApiKey, limits_for
from schemas.events import OrgRecord

log = logging.getLogger(__name__)

#: the shared limiter cannot answer: Redis down, restarting, or too slow
LIMITER_DOWN = (RedisError, OSError)

_WHAT = {"requests": "requests per min (RPM)", "tokens": "tokens per min (TPM)",
         "concurrent": "requests in flight"}


def reads_for(org: OrgRecord, tiers: TierTable) -> int:
    """List reads and resumes a minute, per key and per org: as many as the requests the org may make (its tier's
    rate or its own), counted in a bucket of their own. Each reads at most one page (or rewinds no shared feed), so
    this caps what one key costs Cassandra and the relay at that rate, and it admits what a client of the tier
    does: a list after each create, and a resume of every stream it has in flight at once (``max_concurrent`` is
    below the rate in every tier)."""
    return limits_for(org, tiers).requests_per_minute


@dataclass(frozen=True)
class Ticket:
    """An admitted request: which limiter holds its slots and reservation, and the headers its answer carries."""

    request_id: str
    key_id: str
    org_id: str
    #: reserved at admission: prompt + max_tokens
    tokens: int
    limiter: Limiter
    window: Window
    #: admitted by this process alone (Redis was down): the gateway settles it when the answer ends
    local: bool

    def headers(self) -> dict[str, str]:
        return self.window.headers()


class Admission:
    def __init__(self, shared: Limiter, local: LocalLimiter, tiers: TierTable, holds: HoldPricer | None = None,
                 on_refused: Callable[[ApiKey], None] | None = None) -> None:
        self._shared = shared
        #: told of every refusal, synchronously: it must not do I/O (``refusals.RefusalReport.note``)
        self._on_refused = on_refused
        self._local = local
        self._tiers = tiers
        self._holds = holds
        self._background: set[asyncio.Task[None]] = set()

    def note_refused(self, key: ApiKey) -> None:
        """A request of ``key`` refused before it reached the limiter (``early.py``): the abuse detector counts it as
        a refusal all the same (a key hammering through its 429s is a signal)."""
        if self._on_refused is not None:
            self._on_refused(key)

    def hold_for(self, org: OrgRecord, model: str, prompt_tokens: int, max_tokens: int, at: datetime
                 ) -> BudgetHold | None:
        """The request's budget hold, when its org has a budget (and this gateway prices holds)."""
        if self._holds is None:
            return None
        return self._holds.hold(org, model, prompt_tokens, max_tokens, at)

    async def admit(self, request_id: str, tokens: int, key: ApiKey, budget: BudgetHold | None = None) -> Ticket:
        limits = limits_for(key.org, self._tiers)
        started = time.perf_counter()
        limiter, local = self._shared, False
        try:
            decision = await self._shared.admit(request_id, tokens, key_id=key.key_id, org_id=key.org_id,
                                                key_limits=limits, org_limits=limits, budget=budget)
        except LIMITER_DOWN as exc:
            policy = self._tiers.policy(key.tier).when_redis_down
            LIMITER_REDIS_DOWN.labels(policy=policy).inc()
            log.warning("rate limiter unreachable", extra={"request_id": request_id, "policy": policy,
                                                           "error": repr(exc)})
            decision = None
            if policy == "local":
                limiter, local = self._local, True
                decision = await self._local.admit(request_id, tokens, key_id=key.key_id, org_id=key.org_id,
                                                   key_limits=limits, org_limits=limits)
            if isinstance(exc, RedisTimeoutError):
                # A timeout does not say the script did not run: what it took in Redis is given back once Redis
                # answers (its slots; its tokens too, unless the request goes on to a worker that settles it). A
                # refused connection needs nothing undone: the common case of an outage spawns nothing.
                self._spawn(self._undo_shared(request_id, key, produced=isinstance(decision, Admitted)))
            if decision is None:
                raise unavailable(f"The rate limiter is unavailable, and the {key.tier} tier is not served "
                                  "without it; retry shortly.") from exc
        assert decision is not None  # a closed tier raised above
        kind = "local" if local else "shared"
        LIMITER_SECONDS.labels(limiter=kind).observe(time.perf_counter() - started)
        if isinstance(decision, Refused):
            LIMITER_DECISIONS.labels(outcome=decision.limit, limiter=kind).inc()
            if self._on_refused is not None:
                self._on_refused(key)
            if decision.limit == "budget":
                raise over_budget(decision, key, budget)
            raise rate_limited(decision, tokens, key, local=local)
        LIMITER_DECISIONS.labels(outcome="admitted", limiter=kind).inc()
        return Ticket(request_id, key.key_id, key.org_id, tokens, limiter, decision.window, local)

    async def admit_read(self, key: ApiKey, cost: int = 1) -> ReadWindow:
        """One list read or resume of ``key``, before it reads anything: 429 ``rate_limit_exceeded`` past its reads
        per minute (``reads_for``). With the shared limiter unreachable this process's own read buckets decide,
        whatever the tier's ``when_redis_down``: a read generates nothing, and the local buckets still bound it.
        ``cost``: the reads one that reads more takes (never more than a full bucket: it is always admissible)."""
        reads = reads_for(key.org, self._tiers)
        cost = max(1, min(cost, reads))
        kind = "shared"
        try:
            decision = await self._shared.admit_read(key_id=key.key_id, org_id=key.org_id, key_reads=reads,
                                                     org_reads=reads, cost=cost)
        except LIMITER_DOWN:
            LIMITER_REDIS_DOWN.labels(policy="local").inc()
            kind = "local"
            decision = await self._local.admit_read(key_id=key.key_id, org_id=key.org_id, key_reads=reads,
                                                    org_reads=reads, cost=cost)
        if not decision.admitted:
            LIMITER_DECISIONS.labels(outcome="reads", limiter=kind).inc()
            raise read_limited(decision, key)
        LIMITER_DECISIONS.labels(outcome="read_admitted", limiter=kind).inc()
        return decision.window

    async def end(self, ticket: Ticket, used_tokens: int | None = None) -> None:
        """The client's answer is over: its in-flight slots are free. The worker that finalized the request settles
        its tokens; the gateway settles only what this process alone admitted (with the usage when it knows it,
        else the whole reservation: counted, never refunded)."""
        if ticket.local:
            await self._end(ticket, ticket.tokens if used_tokens is None else used_tokens)
        else:
            await self._end(ticket, None)

    async def unsent(self, ticket: Ticket, *, certain: bool) -> None:
        """The request did not reach Kafka: its slots are free. ``certain``: it never will (nothing produced), so
        its tokens come back too; else (a produce that timed out may still land) a worker may yet bill it, and
        settles it then."""
        await self._end(ticket, 0 if certain or ticket.local else None)

    async def _end(self, ticket: Ticket, settle: int | None) -> None:
        try:
            await ticket.limiter.release(ticket.request_id, key_id=ticket.key_id, org_id=ticket.org_id)
            if settle is not None:
                await ticket.limiter.settle(ticket.request_id, settle)
        except LIMITER_DOWN:
            # The slots end with their lease, the reservation with its TTL.
            log.warning("could not end a rate-limit admission", extra={"request_id": ticket.request_id})

    async def _undo_shared(self, request_id: str, key: ApiKey, *, produced: bool, attempts: int = 30) -> None:
        delay = 0.5
        for _ in range(attempts):
            try:
                await self._shared.release(request_id, key_id=key.key_id, org_id=key.org_id)
                if not produced:
                    await self._shared.settle(request_id, 0)
                return
            except LIMITER_DOWN:
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30.0)

    def _spawn(self, coro: Coroutine[object, object, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def drain(self) -> None:
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)


def over_budget(refused: Refused, key: ApiKey, budget: BudgetHold | None) -> ApiError:
    hold = f" (this request may cost up to ${budget.hold_nanos / 1e9:.9f})" if budget else ""
    return LimitRefusal(refused, 429, f"You exceeded your current quota: organization {key.org_id}'s monthly budget of "
                                      f"${refused.value / 1e9:.2f} is spent{hold}. Raise the budget to be served "
                                      "again.", type="insufficient_quota", code="insufficient_quota",
                        headers=refused.headers())


def read_limited(refused: ReadDecision, key: ApiKey) -> ApiError:
    where = f"organization {key.org_id}" if refused.scope == "org" else f"API key {key.key_id}"
    wait_s = refused.retry_after_ms / 1000
    headers = refused.window.headers() | {"retry-after": str(max(1, math.ceil(wait_s))),
                                          "retry-after-ms": str(refused.retry_after_ms)}
    return ApiError(429, f"Rate limit reached for {where} on reads per min (list reads and stream resumes): "
                         f"Limit {refused.value}. Please try again in {wait_s:.3g}s.",
                    type="requests", code="rate_limit_exceeded", headers=headers)


class LimitRefusal(ApiError):
    """A 429 of the limiter's, saying which limit of whose refused, and whether this process's own limiter did
    (``local``, Redis down): ``early.py`` remembers some of the shared limiter's."""

    def __init__(self, refused: Refused, status: int, message: str, *, local: bool = False, **fields: Any) -> None:
        super().__init__(status, message, **fields)
        self.limit, self.scope, self.local = refused.limit, refused.scope, local


def rate_limited(refused: Refused, tokens: int, key: ApiKey, *, local: bool = False) -> ApiError:
    what = _WHAT[refused.limit]
    where = f"organization {key.org_id}" if refused.scope == "org" else f"API key {key.key_id}"
    headers = refused.headers()
    if refused.retry_after_ms < 0:
        message = (f"Request too large for {where} on {what}: Limit {refused.value}, Requested {tokens}. "
                   "Reduce the prompt or max_tokens (a request reserves its prompt tokens + max_tokens).")
    else:
        wait_s = refused.retry_after_ms / 1000
        headers |= {"retry-after": str(max(1, math.ceil(wait_s))), "retry-after-ms": str(refused.retry_after_ms)}
        message = (f"Rate limit reached for {where} on {what}: Limit {refused.value}. "
                   f"Please try again in {wait_s:.3g}s.")
    kind = "tokens" if refused.limit == "tokens" else "requests"
    return LimitRefusal(refused, 429, message, local=local, type=kind, code="rate_limit_exceeded", headers=headers)
