"""``/v1/responses``: create, retrieve (or resume its stream), cancel, delete. Thin adapters over
:class:`producers.gateway.responses.ResponsesService`."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, Response

from producers.gateway.deps import Caller, Context
from producers.gateway.errors import ApiError, error_responses
from producers.gateway.event_stream import EventStreamResponse
from producers.gateway.protocol import openapi_schema
from producers.gateway.responses_protocol import ResponseCreate
from producers.gateway.routes.chat import RATE_HEADERS, bearer, parse_json, until_answered
from runtime.tracing import child_of

router = APIRouter()

_BODY = {"requestBody": {"required": True,
                         "content": {"application/json": {"schema": openapi_schema(ResponseCreate)}}}}
_CREATE = {
    200: {"headers": RATE_HEADERS, "description": "A `response` object (`queued` for a background one), or with "
          "`stream: true` server-sent `response.*` events, each with its `sequence_number`.",
          "content": {"application/json": {"schema": {"type": "object"}},
                      "text/event-stream": {"schema": {"type": "object"}}}},
    **error_responses({
        400: "Invalid request: a malformed body, an unsupported parameter or input item, an input beyond the "
             "context (`context_length_exceeded`), or a previous response still in progress.",
        401: "No API key, or an unknown one.", 403: "The API key is suspended.",
        404: "The model, the conversation or the previous response does not exist (in your organization).",
        429: "A rate limit or the budget of the key or its organization was reached.",
        502: "The generation failed behind the gateway.",
        503: "A backing service is unavailable, or the request waited past its queue deadline.",
        504: "No token arrived in time.",
    }),
}
_READ = error_responses({400: "A malformed parameter, or a response that cannot be cancelled.",
                         401: "No API key, or an unknown one.",
                         404: "No such response in your organization (unknown, deleted, not stored, or past its "
                              "resume window for a stream).",
                         503: "Stored responses or the stream registry are unavailable."})


@router.post("/v1/responses", response_model=None, responses=_CREATE, openapi_extra=_BODY,
             dependencies=[Depends(bearer)])
async def create_response(request: Request, ctx: Context, key: Caller) -> Response:
    body = parse_json(await request.body(), ResponseCreate)
    traceparent = child_of(request.headers.get("traceparent"))
    accepted, view = await ctx.responses.create(
        body, key, client_addr=request.client.host if request.client else None, traceparent=traceparent)
    headers = {"x-request-id": accepted.request_id, "traceparent": traceparent,
               **(accepted.ticket.headers() if accepted.ticket else {})}
    if body.stream:
        return EventStreamResponse(ctx.responses.stream(accepted, view),
                                   headers={**headers, "cache-control": "no-cache"})
    if body.background:
        return JSONResponse(ctx.responses.queued(accepted, view), headers=headers)
    try:
        result = await until_answered(request, ctx.responses.complete(accepted, view))
    except ApiError as exc:
        exc.headers = {**headers, **(exc.headers or {})}
        raise
    if result is None:
        return Response(status_code=499)
    return JSONResponse(result, headers=headers)


@router.get("/v1/responses/{response_id}", response_model=None, responses=_READ, dependencies=[Depends(bearer)])
async def get_response(
    response_id: str, request: Request, ctx: Context, key: Caller, stream: bool = False,
    starting_after: int | None = Query(default=None, ge=-1, le=999_999_999,
                                       description="The sequence number of the last event the client has."),
) -> Response:
    if not stream:
        return JSONResponse(await ctx.responses.get(response_id, key))
    traceparent = child_of(request.headers.get("traceparent"))
    after = -1 if starting_after is None else starting_after
    accepted, view = await ctx.responses.resume(response_id, key, starting_after=after, traceparent=traceparent)
    return EventStreamResponse(ctx.responses.stream(accepted, view, starting_after=after),
                               headers={"x-request-id": response_id, "traceparent": traceparent,
                                        "cache-control": "no-cache"})


@router.post("/v1/responses/{response_id}/cancel", responses=_READ, dependencies=[Depends(bearer)])
async def cancel_response(response_id: str, request: Request, ctx: Context, key: Caller) -> dict[str, Any]:
    return await ctx.responses.cancel(response_id, key, traceparent=child_of(request.headers.get("traceparent")))


@router.delete("/v1/responses/{response_id}", dependencies=[Depends(bearer)], responses={
    **_READ, **error_responses({409: "The response is still being generated: cancel it (background) or wait."})})
async def delete_response(response_id: str, ctx: Context, key: Caller) -> dict[str, Any]:
    return await ctx.responses.delete(response_id, key)
