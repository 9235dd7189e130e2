"""``GET /health``: 200 while the relay tails its reply partition and the tenancy view follows the registry.
The lease on the partition only spreads gateways over the partitions: a shared or unconfirmed lease is reported,
not fatal (see ``producers/relay/claim.py``)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from producers.gateway.deps import Context

router = APIRouter()


@router.get("/health")
async def health(ctx: Context) -> JSONResponse:
    ok = ctx.relay.healthy and ctx.tenancy.healthy
    body = {
        "status": "ok" if ok else "degraded",
        "instance": ctx.settings.gateway.instance_id,
        "gateway_id": ctx.claim.gateway_id,
        "reply_partition": ctx.claim.partition,
        "reply_lease": "unconfirmed" if ctx.claim.unconfirmed else "shared" if ctx.claim.shared else "held",
        "registry": {"following": ctx.tenancy.healthy, "orgs": len(ctx.tenancy.orgs), "keys": len(ctx.tenancy.keys)},
    }
    return JSONResponse(body, status_code=200 if ok else 503)
