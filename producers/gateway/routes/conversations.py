"""``/v1/conversations`` and their items: thin adapters over
:class:`producers.gateway.conversations.ConversationService`. ``GET /v1/conversations`` (the org's conversations,
newest first) is ours: OpenAI has no listing."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Depends, Query, Request

from producers.gateway.deps import Caller, Context
from producers.gateway.errors import CALLER_ERRORS, READ_LIMITED, error_responses
from producers.gateway.openapi import links
from producers.gateway.protocol import openapi_schema
from producers.gateway.responses_protocol import ConversationCreate, ConversationItemsCreate, ConversationUpdate
from producers.gateway.routes.chat import bearer, parse_json

router = APIRouter(dependencies=[Depends(bearer)], responses=CALLER_ERRORS)

_ERRORS = error_responses({400: "A malformed body or parameter.", 401: "No API key, or an unknown one.",
                           404: "No such conversation or item in your organization (unknown or deleted), or an "
                                "`after` cursor that is not one.",
                           503: "Conversations are unavailable right now."})
#: creates and metadata updates are requests of the key's limits and keep storage within the org's quota
_WRITES = error_responses({429: "A rate limit of the key or its organization was reached (`rate_limit_exceeded`, "
                                "with `Retry-After`), or the organization's conversation storage quota is used "
                                "(`insufficient_quota`: delete conversations; waiting does not help)."})
Limit = Query(default=20, ge=1, le=100)
After = Query(default=None, min_length=1, max_length=256)


def _body(model: type[Any], *, required: bool = True) -> dict[str, Any]:
    return {"requestBody": {"required": required,
                            "content": {"application/json": {"schema": openapi_schema(model)}}}}


#: what a conversation's id leads to
_CONVERSATION = "$response.body#/id"
_CREATED: dict[int | str, dict[str, Any]] = {200: {"description": "The conversation.", **links(
    GetConversation=("getConversation", {"conversation_id": _CONVERSATION}),
    UpdateConversation=("updateConversation", {"conversation_id": _CONVERSATION}),
    ListConversationItems=("listConversationItems", {"conversation_id": _CONVERSATION}),
    CreateConversationItems=("createConversationItems", {"conversation_id": _CONVERSATION}),
    DeleteConversation=("deleteConversation", {"conversation_id": _CONVERSATION}))}}


# Every parameter is optional, as OpenAI's: no body at all creates an empty conversation.
@router.post("/v1/conversations", responses={**_CREATED, **_ERRORS, **_WRITES}, operation_id="createConversation",
             openapi_extra=_body(ConversationCreate, required=False))
async def create_conversation(request: Request, ctx: Context, key: Caller) -> dict[str, Any]:
    raw = await request.body()
    # Parsed once admitted: a throttled key's body costs the gateway nothing
    return await ctx.conversations.create(lambda: parse_json(raw or b"{}", ConversationCreate), key)


@router.get("/v1/conversations", operation_id="listConversations", responses={
    200: {"description": "A page of the organization's conversations, newest first.",
          **links(GetConversation=("getConversation", {"conversation_id": "$response.body#/data/0/id"}))},
    **_ERRORS, **READ_LIMITED})
async def list_conversations(ctx: Context, key: Caller, after: str | None = After,
                             limit: int = Limit) -> dict[str, Any]:
    await ctx.admission.admit_read(key)
    return await ctx.conversations.list(key, after=after, limit=limit)


@router.get("/v1/conversations/{conversation_id}", operation_id="getConversation", responses=_ERRORS)
async def get_conversation(conversation_id: str, ctx: Context, key: Caller) -> dict[str, Any]:
    return await ctx.conversations.get(conversation_id, key)


@router.post("/v1/conversations/{conversation_id}", operation_id="updateConversation",
             responses={**_ERRORS, **_WRITES},
             openapi_extra=_body(ConversationUpdate))
async def update_conversation(conversation_id: str, request: Request, ctx: Context, key: Caller) -> dict[str, Any]:
    raw = await request.body()
    return await ctx.conversations.update(conversation_id, lambda: parse_json(raw, ConversationUpdate).metadata, key)


@router.delete("/v1/conversations/{conversation_id}", operation_id="deleteConversation", responses=_ERRORS)
async def delete_conversation(conversation_id: str, ctx: Context, key: Caller) -> dict[str, Any]:
    return await ctx.conversations.delete(conversation_id, key)


@router.get("/v1/conversations/{conversation_id}/items", operation_id="listConversationItems", responses={
    200: {"description": "A page of the conversation's items.",
          **links(GetConversationItem=("getConversationItem", {"conversation_id": "$request.path.conversation_id",
                                                                "item_id": "$response.body#/data/0/id"}))},
    **_ERRORS, **READ_LIMITED})
async def list_items(conversation_id: str, ctx: Context, key: Caller, after: str | None = After,
                     limit: int = Limit, order: Literal["asc", "desc"] = Query(default="desc")) -> dict[str, Any]:
    await ctx.admission.admit_read(key)
    return await ctx.conversations.items(conversation_id, key, after=after, limit=limit, ascending=order == "asc")


@router.post("/v1/conversations/{conversation_id}/items", operation_id="createConversationItems", responses={
    200: {"description": "The items added, after the conversation's newest.",
          **links(GetConversationItem=("getConversationItem", {"conversation_id": "$request.path.conversation_id",
                                                                "item_id": "$response.body#/data/0/id"}),
                  DeleteConversationItem=("deleteConversationItem", {
                      "conversation_id": "$request.path.conversation_id", "item_id": "$response.body#/data/0/id"}))},
    **_ERRORS, **_WRITES}, openapi_extra=_body(ConversationItemsCreate))
async def create_items(conversation_id: str, request: Request, ctx: Context, key: Caller) -> dict[str, Any]:
    raw = await request.body()
    return await ctx.conversations.add_items(conversation_id, lambda: parse_json(raw, ConversationItemsCreate), key)


@router.delete("/v1/conversations/{conversation_id}/items/{item_id}", operation_id="deleteConversationItem",
               responses={**_ERRORS, **_WRITES})
async def delete_item(conversation_id: str, item_id: str, ctx: Context, key: Caller) -> dict[str, Any]:
    return await ctx.conversations.delete_item(conversation_id, item_id, key)


@router.get("/v1/conversations/{conversation_id}/items/{item_id}", operation_id="getConversationItem",
            responses=_ERRORS)
async def get_item(conversation_id: str, item_id: str, ctx: Context, key: Caller) -> dict[str, Any]:
    return await ctx.conversations.item(conversation_id, item_id, key)
