"""Callers for unit tests that need one without a registry."""

from __future__ import annotations

from producers.gateway.admission import Admission
from producers.gateway.local_limiter import LocalLimiter
from runtime.settings import TierTable
from runtime.tenancy import ApiKey
from schemas.events import KeyRecord, LimitOverrides, OrgRecord, utcnow


def local_admission(tiers: TierTable | None = None) -> Admission:
    """The gateway's admission over a process-local limiter (the pure logic; Redis's is tested on Redis)."""
    return Admission(LocalLimiter(), LocalLimiter(), tiers or TierTable.model_validate({}))


def api_key(key_id: str = "k", org_id: str = "org", tier: str = "plus", models: list[str] | None = None,
            limits: LimitOverrides | None = None) -> ApiKey:
    now = utcnow()
    return ApiKey(KeyRecord(key_hash="h-" + key_id, key_id=key_id, org_id=org_id, name="n", models=models or [],
                            created_at=now),
                  OrgRecord(org_id=org_id, name=org_id, tier=tier, limits=limits or LimitOverrides(), created_at=now,
                            updated_at=now))
