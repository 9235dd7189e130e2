"""Callers for unit tests that need one without a registry."""

from __future__ import annotations

from producers.tenancy.view import ApiKey
from schemas.events import KeyRecord, OrgRecord, utcnow


def api_key(key_id: str = "k", org_id: str = "org", tier: str = "plus", models: list[str] | None = None) -> ApiKey:
    now = utcnow()
    return ApiKey(KeyRecord(key_hash="h-" + key_id, key_id=key_id, org_id=org_id, name="n", models=models or [],
                            created_at=now),
                  OrgRecord(org_id=org_id, name=org_id, tier=tier, created_at=now, updated_at=now))
