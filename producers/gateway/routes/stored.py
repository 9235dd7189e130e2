"""Stored chat completions: list, messages, delete (``GET /v1/chat/completions/{id}`` is in ``chat.py``, beside
resuming a stream by id). Thin adapters over :class:`producers.gateway.stored.StoredCompletions`."""

from __future__ import annotations

import re
from typing import Any, Literal

from fastapi import APIRouter, Query, Request

from producers.gateway.deps import Caller, Context
from producers.gateway.errors import CALLER_ERRORS, READ_LIMITED, bad_request, error_responses
from producers.gateway.openapi import links

router = APIRouter(responses=CALLER_ERRORS)

#: ``metadata[key]=value`` query parameters (OpenAI's filter)
_METADATA = re.compile(r"^metadata\[(.{1,64})\]$")
_ERRORS = error_responses({400: "A malformed parameter.", 401: "No API key, or an unknown one.",
                           404: "No stored completion with that id (or the `after` cursor's) in your organization.",
                           503: "Stored completions are unavailable right now."})
Limit = Query(default=20, ge=1, le=100)
Order = Query(default="asc")
#: a completion or message id to page after (unknown: 404)
After = Query(default=None, min_length=1, max_length=256)


def _metadata(request: Request) -> dict[str, str]:
    found = {}
    for name, value in request.query_params.multi_items():
        match = _METADATA.match(name)
        if match:
            found[match.group(1)] = value
        elif name.startswith("metadata"):
            raise bad_request(f"Filter on metadata as `metadata[key]=value`, not `{name}`.", param=name,
                              code="invalid_parameter")
    return found


@router.get("/v1/chat/completions", operation_id="listChatCompletions", responses={
    200: {"description": "A page of the organization's stored completions.",
          **links(GetChatCompletion=("getChatCompletion", {"completion_id": "$response.body#/data/0/id"}))},
    **_ERRORS, **READ_LIMITED})
async def list_chat_completions(request: Request, ctx: Context, key: Caller, model: str | None = None,
                                after: str | None = After, limit: int = Limit,
                                order: Literal["asc", "desc"] = Order) -> dict[str, Any]:
    await ctx.admission.admit_read(key)
    return await ctx.stored.list(key.org_id, after=after, limit=limit, ascending=order == "asc", model=model,
                                 metadata=_metadata(request))


@router.get("/v1/chat/completions/{completion_id}/messages", operation_id="getChatCompletionMessages",
            responses={**_ERRORS, **READ_LIMITED})
async def chat_completion_messages(completion_id: str, ctx: Context, key: Caller, after: str | None = After,
                                   limit: int = Limit, order: Literal["asc", "desc"] = Order) -> dict[str, Any]:
    await ctx.admission.admit_read(key)
    return await ctx.stored.messages(completion_id, key.org_id, after=after, limit=limit, ascending=order == "asc")


@router.delete("/v1/chat/completions/{completion_id}", operation_id="deleteChatCompletion", responses=_ERRORS)
async def delete_chat_completion(completion_id: str, ctx: Context, key: Caller) -> dict[str, Any]:
    return await ctx.stored.delete(completion_id, key.org_id)
