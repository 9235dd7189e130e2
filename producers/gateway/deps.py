"""Request-scoped dependencies: the gateway's components and the caller's API key."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from starlette.exceptions import HTTPException as StarletteHTTPException

from billing.ledger import Ledger
from producers.gateway.admission import LIMITER_DOWN, Admission
from producers.gateway.conversations import ConversationService
from producers.gateway.errors import ApiError, unauthorized
from producers.gateway.keys import hash_key
from producers.gateway.prompt import PromptBuilder
from producers.gateway.responses import ResponsesService
from producers.gateway.service import ChatService
from producers.gateway.stored import StoredCompletions
from producers.gateway.tokenization import Tokenization
from producers.relay.claim import ReplyPartitionClaim
from producers.relay.demux import Relay
from producers.tenancy.admin import TenancyAdmin
from runtime.settings import Settings
from runtime.suspensions import KeySuspensions
from runtime.tenancy import ApiKey, Refusal, TenancyView


@dataclass
class GatewayContext:
    """Everything the routes use, built once in the app's lifespan."""

    settings: Settings
    tenancy: TenancyView
    admin: TenancyAdmin
    suspensions: KeySuspensions
    ledger: Ledger
    prompts: PromptBuilder
    claim: ReplyPartitionClaim
    relay: Relay
    chat: ChatService
    stored: StoredCompletions
    responses: ResponsesService
    conversations: ConversationService
    #: list reads and resumes take a read from it (``Admission.admit_read``) before they read anything
    admission: Admission
    tokenization: Tokenization


async def context(request: Request) -> GatewayContext:
    # async: FastAPI runs a plain ``def`` dependency in its thread pool, a thread hop on every request
    ctx: GatewayContext = request.app.state.ctx
    return ctx


Context = Annotated[GatewayContext, Depends(context)]

_REFUSALS = {
    Refusal.UNKNOWN: ("Incorrect API key provided.", "invalid_api_key"),
    Refusal.REVOKED: ("This API key has been revoked.", "invalid_api_key"),
    Refusal.EXPIRED: ("This API key has expired.", "expired_api_key"),
}


async def _key_of(request: Request, ctx: GatewayContext) -> ApiKey:
    header = request.headers.get("authorization", "")
    scheme, _, secret = header.partition(" ")
    if scheme.lower() != "bearer" or not secret.strip():
        raise unauthorized(
            "You didn't provide an API key. You need to provide your API key in an Authorization header "
            "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).",
            code=None,
        )
    found = await ctx.tenancy.authenticate(hash_key(secret.strip()))
    if isinstance(found, Refusal):
        message, code = _REFUSALS[found]
        raise unauthorized(message, code=code)
    return found


async def authenticate(request: Request, ctx: Context) -> ApiKey:
    key = await _key_of(request, ctx)
    if key.key.admin:
        raise ApiError(403, "An admin key only works on the admin API (/v1/admin/...).", type="permission_error",
                       code="admin_key_not_allowed")
    try:
        suspended = await ctx.suspensions.reason(key.key_id)
    except LIMITER_DOWN:
        # Redis down: a tier served without it (``when_redis_down: local``) is refused only if this gateway last saw
        # its key suspended (a key suspended meanwhile is served until Redis is back, when the detector's
        # suspension takes effect); the others get the 503 a backing service's outage gets.
        if ctx.settings.tenancy.tiers.policy(key.tier).when_redis_down != "local":
            raise
        suspended = ctx.suspensions.last_known(key.key_id)
    if suspended is not None:
        raise ApiError(403, f"This API key is suspended ({suspended}). An operator can lift the suspension.",
                       type="permission_error", code="key_suspended")
    return key


async def authenticate_admin(request: Request, ctx: Context) -> ApiKey:
    key = await _key_of(request, ctx)
    if not key.key.admin:
        raise ApiError(403, "The admin API needs an admin key (`kns keys create-admin`).", type="permission_error",
                       code="insufficient_permissions")
    return key


def on_internal_port(request: Request, settings: Settings) -> bool:
    """Whether the request came in on the gateway's internal port (``gateway.internal_port``), not the public one."""
    server = request.scope.get("server") or (None, None)
    return server[1] == settings.gateway.internal_port


async def internal_only(request: Request, ctx: Context) -> None:
    """What only the internal port serves (``/metrics``) is not found on the public one, as any unknown URL."""
    if not on_internal_port(request, ctx.settings):
        raise StarletteHTTPException(404)


Caller = Annotated[ApiKey, Depends(authenticate)]
Admin = Annotated[ApiKey, Depends(authenticate_admin)]
