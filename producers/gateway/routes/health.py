"""``GET /health``: 200 while the relay tails its reply partition and the tenancy view follows the registry, else 503.

The public port answers that alone (``{"status": "ok"}``): nothing about tenants, instances or partitions. The
internal port (``gateway.internal_port``, with ``/metrics``) adds the details an operator reads: the instance and
its gateway id, the reply partition and its lease, the registry's size. The lease on the partition only spreads
gateways over the partitions: a shared or unconfirmed lease is reported, not fatal (see ``producers/relay/claim.py``).
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from producers.gateway.deps import Context, on_internal_port

router = APIRouter()


@router.get("/health", include_in_schema=False)
async def health(request: Request, ctx: Context) -> JSONResponse:
    ok = ctx.relay.healthy and ctx.tenancy.healthy
    body: dict[str, object] = {"status": "ok" if ok else "degraded"}
    if on_internal_port(request, ctx.settings):
        body |= {
            "instance": ctx.settings.gateway.instance_id,
            "gateway_id": ctx.claim.gateway_id,
            "reply_partition": ctx.claim.partition,
            "reply_lease": "unconfirmed" if ctx.claim.unconfirmed else "shared" if ctx.claim.shared else "held",
            "registry": {"following": ctx.tenancy.healthy, "orgs": len(ctx.tenancy.orgs),
                         "keys": len(ctx.tenancy.keys)},
        }
    return JSONResponse(body, status_code=200 if ok else 503)
