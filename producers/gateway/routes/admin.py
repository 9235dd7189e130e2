"""``/v1/admin/...``: orgs and keys, behind an admin key, each use case in the key's scope (a platform operator's:
every org; an org admin's: its own org alone; ``producers/tenancy/admin.py``). Thin adapters over
:class:`TenancyAdmin` (its ``TenancyError`` becomes the OpenAI error shape in ``errors.install``).

The admin API is left out of the public ``/openapi.json``; its own document is ``GET /v1/admin/openapi.json``, for
admin keys.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, TypeVar

import orjson
from fastapi import APIRouter, Request
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ValidationError

from producers.gateway.deps import Admin, Context
from producers.gateway.errors import bad_request, error_responses, from_validation
from producers.tenancy.admin import (
    MICROS,
    IssuedKey,
    KeyCreate,
    KeyRotate,
    OrgCreate,
    OrgUpdate,
    Scope,
    scope_of,
)
from runtime.tenancy import ApiKey
from schemas.events import KeyRecord, OrgRecord

router = APIRouter(prefix="/v1/admin", tags=["admin"])
M = TypeVar("M", bound=BaseModel)

RESPONSES = error_responses({
    400: "Invalid input: malformed JSON, an unknown field, a negative limit, an unknown tier, a past expiry.",
    401: "No API key, or an unknown one.",
    403: "The key is not an admin key, or an org admin's key asked for what only a platform operator may do "
         "(create an org, change a tier, raise a limit past the tier's, issue a platform operator key).",
    404: "No such organization or key (or one of another org, for an org admin).",
    409: "The organization exists already, or the key is revoked.",
    503: "The registry cannot be written now (Kafka unavailable); nothing changed.",
})


def _ts(value: datetime | None) -> int | None:
    return None if value is None else int(value.timestamp())


def org_json(org: OrgRecord) -> dict[str, Any]:
    budget = org.monthly_budget_micros
    return {"object": "organization", "id": org.org_id, "name": org.name, "tier": org.tier,
            "limits": org.limits.model_dump(),
            "monthly_budget_usd": None if budget is None else str(budget / MICROS),
            "budget_alert_fraction": org.budget_alert_fraction,
            "created_at": _ts(org.created_at), "updated_at": _ts(org.updated_at)}


def key_json(key: KeyRecord, secret: str | None = None) -> dict[str, Any]:
    body = {"object": "api_key", "id": key.key_id, "org_id": key.org_id, "name": key.name, "admin": key.admin,
            "models": key.models, "created_at": _ts(key.created_at), "expires_at": _ts(key.expires_at),
            "revoked_at": _ts(key.revoked_at)}
    if secret is not None:
        body["value"] = secret  # shown once
    return body


def _issued(issued: IssuedKey) -> dict[str, Any]:
    return key_json(issued.record, issued.secret)


async def _parse(request: Request, model: type[M]) -> M:
    raw = await request.body()
    try:
        data = orjson.loads(raw or b"{}")
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"The body is not valid JSON: {exc}", code="invalid_json") from exc
    if not isinstance(data, dict):
        raise bad_request("The body must be a JSON object.", code="invalid_json")
    try:
        # Strict, in JSON mode: ISO strings for times, numbers or strings for money, nothing coerced from a bool.
        return model.model_validate_json(raw or b"{}")
    except ValidationError as exc:
        raise from_validation(exc) from exc


def _scope(admin: ApiKey) -> Scope:
    return scope_of(admin.key)


@router.post("/orgs", status_code=201, responses=RESPONSES)
async def create_org(request: Request, ctx: Context, admin: Admin) -> dict[str, Any]:
    spec = await _parse(request, OrgCreate)
    return org_json(await ctx.admin.create_org(spec, _scope(admin)))


@router.get("/orgs", responses=RESPONSES)
async def list_orgs(ctx: Context, admin: Admin) -> dict[str, Any]:
    return {"object": "list", "data": [org_json(o) for o in ctx.admin.orgs(_scope(admin))]}


@router.get("/orgs/{org_id}", responses=RESPONSES)
async def get_org(org_id: str, ctx: Context, admin: Admin) -> dict[str, Any]:
    return org_json(ctx.admin.org(org_id, _scope(admin)))


@router.patch("/orgs/{org_id}", responses=RESPONSES)
async def update_org(org_id: str, request: Request, ctx: Context, admin: Admin) -> dict[str, Any]:
    change = await _parse(request, OrgUpdate)
    return org_json(await ctx.admin.update_org(org_id, change, _scope(admin)))


@router.post("/orgs/{org_id}/keys", status_code=201, responses=RESPONSES)
async def create_key(org_id: str, request: Request, ctx: Context, admin: Admin) -> dict[str, Any]:
    spec = await _parse(request, KeyCreate)
    return _issued(await ctx.admin.create_key(org_id, spec, _scope(admin)))


@router.get("/orgs/{org_id}/keys", responses=RESPONSES)
async def list_keys(org_id: str, ctx: Context, admin: Admin) -> dict[str, Any]:
    return {"object": "list", "data": [key_json(k) for k in ctx.admin.keys(org_id, _scope(admin))]}


@router.get("/keys/{key_id}", responses=RESPONSES)
async def get_key(key_id: str, ctx: Context, admin: Admin) -> dict[str, Any]:
    return key_json(ctx.admin.key(key_id, _scope(admin)))


@router.post("/keys/{key_id}/rotate", responses=RESPONSES)
async def rotate_key(key_id: str, request: Request, ctx: Context, admin: Admin) -> dict[str, Any]:
    spec = await _parse(request, KeyRotate)
    return _issued(await ctx.admin.rotate_key(key_id, spec, _scope(admin)))


@router.delete("/keys/{key_id}", responses=RESPONSES)
async def revoke_key(key_id: str, ctx: Context, admin: Admin) -> dict[str, Any]:
    return key_json(await ctx.admin.revoke_key(key_id, _scope(admin)))


@router.get("/openapi.json", include_in_schema=False)
async def admin_openapi(request: Request, _admin: Admin) -> dict[str, Any]:
    """The admin API's own OpenAPI document (the public one leaves it out)."""
    app = request.app
    return get_openapi(title=f"{app.title} admin API", version=app.version, routes=router.routes)
