"""The limits each org is granted, as the gateways enforce them: the abuse detector follows the tenancy registry with
the gateways' own view (``runtime/tenancy.py``), so its thresholds move with an org's limits (overrides included)
within the registry's fetch latency.

Must not: answer before the view has read the registry to its end (an org's overrides would be missed, and its
keys judged by the tier's limits).
"""

from __future__ import annotations

import asyncio
import logging

from aiokafka.errors import KafkaError

from runtime.limiter import Limits
from runtime.settings import TierTable
from runtime.tenancy import TenancyView, limits_for

log = logging.getLogger(__name__)


class GrantedLimits:
    def __init__(self, view: TenancyView, tiers: TierTable, *, retry_s: float = 5.0) -> None:
        self._view = view
        self._tiers = tiers
        self._retry_s = retry_s
        self._ready = asyncio.Event()

    async def follow(self) -> None:
        """Read the registry to its end, then follow it until cancelled (the processor's task)."""
        while True:
            try:
                await self._view.start()
                break
            except (TimeoutError, KafkaError) as exc:  # the agents wait meanwhile: no key is judged blind
                log.warning("tenancy registry not readable; retrying", extra={"error": repr(exc)})
                await self._view.stop()
                await asyncio.sleep(self._retry_s)
        self._ready.set()
        try:
            await asyncio.Event().wait()
        finally:
            await self._view.stop()

    async def of(self, org_id: str, tier: str) -> Limits:
        """The org's effective limits; an org the registry does not know (any more) gets its tier's."""
        await self._ready.wait()
        org = self._view.orgs.get(org_id)
        if org is not None:
            return limits_for(org, self._tiers)
        policy = self._tiers.policy(tier)
        return Limits(policy.requests_per_minute, policy.tokens_per_minute, policy.max_concurrent)
