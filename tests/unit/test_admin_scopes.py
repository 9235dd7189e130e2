"""Admin scopes (issue 37 M4): a platform operator administers every org; an org admin its own org alone (another
org and its keys are not found), within its tier; platform operator keys are never issued over HTTP. The registry
writer is a fake that applies each change to the view at once (the real one is tested on Kafka)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from decimal import Decimal

import pytest

from producers.tenancy.admin import (
    OPERATORS_ORG,
    PLATFORM,
    KeyCreate,
    KeyRotate,
    Limits,
    OrgCreate,
    OrgUpdate,
    Scope,
    TenancyAdmin,
    TenancyError,
    scope_of,
)
from runtime.settings import KafkaSettings, TierTable
from runtime.tenancy import TenancyView
from schemas.events import Event, KeyRecord, OrgRecord


class AppliedAtOnce:
    """The registry writer, as the view sees its changes: applied when the change ends."""

    def __init__(self, view: TenancyView) -> None:
        self._view = view

    @asynccontextmanager
    async def change(self) -> AsyncIterator[list[Event]]:
        records: list[Event] = []
        yield records
        for record in records:
            if isinstance(record, OrgRecord):
                self._view.orgs[record.org_id] = record
            elif isinstance(record, KeyRecord):
                self._view.keys[record.key_hash] = record
                self._view._hashes_of[record.key_id].add(record.key_hash)


@pytest.fixture
async def admin() -> TenancyAdmin:
    view = TenancyView(KafkaSettings())
    tenancy = TenancyAdmin(view, AppliedAtOnce(view), TierTable.model_validate({}).policies())  # type: ignore[arg-type]
    for org in ("acme", "victim"):
        await tenancy.create_org(OrgCreate(org_id=org, tier="plus"))
    await tenancy.create_org(OrgCreate(org_id=OPERATORS_ORG, tier="enterprise"))
    return tenancy


async def _org_admin(admin: TenancyAdmin, org_id: str) -> Scope:
    """An org admin key, minted over HTTP by a platform operator, and the scope it gets."""
    operator = scope_of((await admin.create_key(OPERATORS_ORG, KeyCreate(admin=True))).record)
    assert operator.operator and not operator.mints_operators
    issued = await admin.create_key(org_id, KeyCreate(admin=True), operator)
    return scope_of(issued.record)


async def test_an_org_admin_sees_and_changes_its_own_org_alone(admin: TenancyAdmin) -> None:
    acme = await _org_admin(admin, "acme")
    victims_key = (await admin.create_key("victim", KeyCreate(name="theirs"))).record
    assert [o.org_id for o in admin.orgs(acme)] == ["acme"]
    assert admin.org("acme", acme).org_id == "acme"
    reads = [lambda: admin.org("victim", acme), lambda: admin.keys("victim", acme),
             lambda: admin.key(victims_key.key_id, acme)]
    for read in reads:
        with pytest.raises(TenancyError) as refused:
            read()
        assert refused.value.status == 404 and refused.value.code in ("organization_not_found", "api_key_not_found")
    changes = [admin.update_org("victim", OrgUpdate(name="pwned"), acme),
               admin.create_key("victim", KeyCreate(), acme),
               admin.rotate_key(victims_key.key_id, KeyRotate(), acme),
               admin.revoke_key(victims_key.key_id, acme)]
    for change in changes:
        with pytest.raises(TenancyError) as refused:
            await change
        assert refused.value.status == 404
    victim = admin.org("victim")
    assert victim.name == "victim" and admin.key(victims_key.key_id).revoked_at is None
    assert [k.key_id for k in admin.keys("victim")] == [victims_key.key_id]
    # its own org: keys (an org admin of its own too), name, budget
    own = await admin.create_key("acme", KeyCreate(name="ci"), acme)
    assert (await admin.create_key("acme", KeyCreate(admin=True), acme)).record.admin
    await admin.revoke_key(own.record.key_id, acme)
    renamed = await admin.update_org("acme", OrgUpdate(name="Acme", monthly_budget_usd=Decimal(100)), acme)
    assert (renamed.name, renamed.monthly_budget_micros) == ("Acme", 100_000_000)


async def test_an_org_admin_keeps_its_tier_and_its_limits_within_the_tiers(admin: TenancyAdmin) -> None:
    acme = await _org_admin(admin, "acme")  # plus: 600 rpm, 500,000 tpm, 64 in flight
    for forbidden, param in [(OrgUpdate(tier="enterprise"), "tier"),
                             (OrgUpdate(limits=Limits(requests_per_minute=601)), "limits.requests_per_minute"),
                             (OrgUpdate(limits=Limits(max_concurrent=65)), "limits.max_concurrent")]:
        with pytest.raises(TenancyError) as refused:
            await admin.update_org("acme", forbidden, acme)
        assert (refused.value.status, refused.value.code, refused.value.param) == (
            403, "insufficient_permissions", param)
    assert admin.org("acme").tier == "plus" and admin.org("acme").limits.requests_per_minute is None
    lowered = await admin.update_org("acme", OrgUpdate(limits=Limits(requests_per_minute=100)), acme)
    assert lowered.limits.requests_per_minute == 100
    assert (await admin.update_org("acme", OrgUpdate(limits=Limits(requests_per_minute=600)), acme)
            ).limits.requests_per_minute == 600
    # more than the tier's, granted by an operator: kept, lowered, never raised again past it
    await admin.update_org("acme", OrgUpdate(limits=Limits(requests_per_minute=2000)), PLATFORM)
    assert (await admin.update_org("acme", OrgUpdate(limits=Limits(requests_per_minute=1500)), acme)
            ).limits.requests_per_minute == 1500
    with pytest.raises(TenancyError):
        await admin.update_org("acme", OrgUpdate(limits=Limits(requests_per_minute=1501)), acme)
    assert (await admin.update_org("acme", OrgUpdate(tier="plus"), acme)).tier == "plus"  # its own tier: no change


async def test_only_a_platform_operator_creates_orgs_and_none_mints_operators_over_http(admin: TenancyAdmin
                                                                                         ) -> None:
    acme = await _org_admin(admin, "acme")
    with pytest.raises(TenancyError) as refused:
        await admin.create_org(OrgCreate(org_id="mine", tier="enterprise"), acme)
    assert refused.value.status == 403 and "mine" not in admin.view.orgs
    with pytest.raises(TenancyError) as hidden:
        await admin.create_key(OPERATORS_ORG, KeyCreate(admin=True), acme)
    assert hidden.value.status == 404
    operator_over_http = Scope()
    with pytest.raises(TenancyError) as refused:
        await admin.create_key(OPERATORS_ORG, KeyCreate(admin=True), operator_over_http)
    assert (refused.value.status, refused.value.param) == (403, "admin")
    # an operator over HTTP administers every org, and may mint an org admin for any of them
    assert {o.org_id for o in admin.orgs(operator_over_http)} == {"acme", "victim", OPERATORS_ORG}
    assert scope_of((await admin.create_key("victim", KeyCreate(admin=True), operator_over_http)).record) == Scope(
        org_id="victim")
    # the CLI mints platform operator keys
    assert (await admin.create_key(OPERATORS_ORG, KeyCreate(admin=True), PLATFORM)).record.admin
