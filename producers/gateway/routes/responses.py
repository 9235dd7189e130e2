"""``/v1/responses``: create, retrieve (or resume its stream), cancel, delete. Thin adapters over
:class:`producers.gateway.responses.ResponsesService`."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, Response

from producers.gateway.deps import Caller, Context
from producers.gateway.errors import CALLER_ERRORS, READ_LIMITED, ApiError, error_responses
from producers.gateway.event_stream import EventStreamResponse
from producers.gateway.openapi import CREATED_ID, REQUEST_ID_HEADER, links
from producers.gateway.protocol import openapi_schema
from producers.gateway.responses_protocol import ResponseCreate
from producers.gateway.routes.chat import RATE_HEADERS, bearer, parse_json, until_answered
from runtime.tracing import child_of

router = APIRouter(responses=CALLER_ERRORS)

_BODY = {"requestBody": {"required": True,
                         "content": {"application/json": {"schema": openapi_schema(ResponseCreate)}}}}
_CREATE = {
    200: {"headers": {**REQUEST_ID_HEADER, **RATE_HEADERS},
          "description": "A `response` object (`queued` for a background one), or with `stream: true` server-sent "
                         "`response.*` events, each with its `sequence_number`.",
          "content": {"application/json": {"schema": {"type": "object"}},
                      "text/event-stream": {"schema": {"type": "object"}}},
          **links(GetResponse=("getResponse", {"response_id": CREATED_ID}),
                  ResumeResponseStream=("getResponse", {"response_id": CREATED_ID, "stream": True}),
                  CancelResponse=("cancelResponse", {"response_id": CREATED_ID}),
                  ListResponseInputItems=("listResponseInputItems", {"response_id": CREATED_ID}),
                  DeleteResponse=("deleteResponse", {"response_id": CREATED_ID}))},
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
             dependencies=[Depends(bearer)], operation_id="createResponse")
async def create_response(request: Request, ctx: Context, key: Caller) -> Response:
    ctx.chat.refuse_early(key)  # a throttled key: 429 before its body is even parsed
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


#: a response object, or with ``stream=true`` the rest of its stream
_RETRIEVED: dict[int | str, dict[str, Any]] = {200: {
    "description": "The `response` object; with `stream=true`, the rest of its stream as server-sent `response.*` "
                   "events after `starting_after`, within its resume window.",
    "content": {"application/json": {"schema": {"type": "object"}},
                "text/event-stream": {"schema": {"type": "object"}}},
}}


@router.get("/v1/responses/{response_id}", response_model=None, responses={**_RETRIEVED, **_READ, **READ_LIMITED},
            dependencies=[Depends(bearer)],
            operation_id="getResponse")
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


@router.get("/v1/responses/{response_id}/input_items", dependencies=[Depends(bearer)],
            operation_id="listResponseInputItems", responses={**_READ, **READ_LIMITED})
async def list_input_items(response_id: str, ctx: Context, key: Caller,
                           after: str | None = Query(default=None, min_length=1, max_length=256),
                           limit: int = Query(default=20, ge=1, le=100),
                           order: Literal["asc", "desc"] = Query(default="desc")) -> dict[str, Any]:
    await ctx.admission.admit_read(key)
    return await ctx.responses.input_items(response_id, key, after=after, limit=limit, ascending=order == "asc")


@router.post("/v1/responses/{response_id}/cancel", dependencies=[Depends(bearer)], responses={
    **_READ, **error_responses({409: "The response has already ended (one that ran in the foreground); there is "
                                     "nothing to cancel (`response_finished`)."})},
             operation_id="cancelResponse")
async def cancel_response(response_id: str, request: Request, ctx: Context, key: Caller) -> dict[str, Any]:
    return await ctx.responses.cancel(response_id, key, traceparent=child_of(request.headers.get("traceparent")))


@router.delete("/v1/responses/{response_id}", dependencies=[Depends(bearer)], operation_id="deleteResponse", responses={
    **_READ, **error_responses({409: "The response is still being generated: cancel it (background) or wait."})})
async def delete_response(response_id: str, ctx: Context, key: Caller) -> dict[str, Any]:
    return await ctx.responses.delete(response_id, key)
