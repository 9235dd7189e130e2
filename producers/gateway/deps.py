"""Request-scoped dependencies: the gateway's components and the caller's API key."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from billing.ledger import Ledger
from producers.gateway.errors import ApiError, unauthorized
from producers.gateway.keys import ApiKey, ApiKeyRegistry, KeySuspensions
from producers.gateway.prompt import PromptBuilder
from producers.gateway.service import ChatService
from producers.relay.claim import ReplyPartitionClaim
from producers.relay.demux import Relay
from runtime.settings import Settings


@dataclass
class GatewayContext:
    """Everything the routes use, built once in the app's lifespan."""

    settings: Settings
    keys: ApiKeyRegistry
    suspensions: KeySuspensions
    ledger: Ledger
    prompts: PromptBuilder
    claim: ReplyPartitionClaim
    relay: Relay
    chat: ChatService


def context(request: Request) -> GatewayContext:
    ctx: GatewayContext = request.app.state.ctx
    return ctx


Context = Annotated[GatewayContext, Depends(context)]


async def authenticate(request: Request, ctx: Context) -> ApiKey:
    header = request.headers.get("authorization", "")
    scheme, _, secret = header.partition(" ")
    if scheme.lower() != "bearer" or not secret.strip():
        raise unauthorized(
            "You didn't provide an API key. You need to provide your API key in an Authorization header "
            "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).",
            code=None,
        )
    key = await ctx.keys.lookup(secret.strip())
    if key is None:
        raise unauthorized("Incorrect API key provided.")
    suspended = await ctx.suspensions.reason(key.key_id)
    if suspended is not None:
        raise ApiError(403, f"This API key is suspended ({suspended}). An operator can lift the suspension.",
                       type="permission_error", code="key_suspended")
    return key


Caller = Annotated[ApiKey, Depends(authenticate)]
