"""``GET /health``: 200 while the relay tails its reply partition and the claim on it is held."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from producers.gateway.deps import Context

router = APIRouter()


@router.get("/health")
async def health(ctx: Context) -> JSONResponse:
    ok = ctx.relay.healthy and not ctx.claim.lost.is_set()
    body = {
        "status": "ok" if ok else "degraded",
        "instance": ctx.settings.gateway.instance_id,
        "reply_partition": ctx.claim.partition,
    }
    return JSONResponse(body, status_code=200 if ok else 503)
