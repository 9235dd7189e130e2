"""``POST /v1/chat/completions`` and resuming its streams: thin adapters from HTTP to :class:`ChatService`.

A stream is resumed on any gateway by the request a reconnecting client sends: the same ``POST`` with a
``Last-Event-ID`` header (an SDK retrying), or ``GET /v1/chat/completions/{id}?stream=true`` with ``Last-Event-ID``
or ``starting_after`` (a browser's ``EventSource``; neither: the whole stream).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

import orjson
from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPBearer
from pydantic import BaseModel, ValidationError

from producers.gateway.deps import Caller, Context
from producers.gateway.errors import (
    CALLER_ERRORS,
    READ_LIMITED,
    ApiError,
    ErrorResponse,
    bad_request,
    error_responses,
    from_validation,
)
from producers.gateway.event_stream import EventStreamResponse
from producers.gateway.openapi import CREATED_ID, REQUEST_ID_HEADER, links
from producers.gateway.protocol import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    chat_request_schema,
    openapi_schema,
)
from runtime.streams import parse_event_id
from runtime.tracing import child_of

router = APIRouter(responses=CALLER_ERRORS)
log = logging.getLogger(__name__)
Body = TypeVar("Body", bound=BaseModel)
Answer = TypeVar("Answer")

#: Declares the bearer scheme in ``/openapi.json`` only: ``deps.authenticate`` checks the key (this one never
#: refuses, auto_error is off, so a missing key still gets our 401 body).
bearer = HTTPBearer(auto_error=False, description="An API key (`kns keys create`).")

#: What ``/openapi.json`` says this route reads and answers. The body is parsed by :func:`parse_body` (raw bytes,
#: our error shape), so FastAPI only documents the schema, it never validates with it.
#: Whether a stream's events carry their ``id:`` (the resume position); the gateway's ``sse_event_ids`` when absent
EVENT_IDS_HEADER = "kns-event-ids"
_SWITCH = {"on": True, "true": True, "1": True, "off": False, "false": False, "0": False}
OPENAPI_BODY = {
    "requestBody": {"required": True, "content": {"application/json": {"schema": chat_request_schema()}}},
    "parameters": [{
        "name": EVENT_IDS_HEADER, "in": "header", "required": False,
        "schema": {"type": "string", "enum": sorted(_SWITCH)},
        "description": "`off`: stream events without their `id:` line (OpenAI's exact bytes, for SSE parsers that "
                       "read one `data:` line per event; such a stream can only be resumed from its start). "
                       "Default: the gateway's `sse_event_ids` (on).",
    }],
}
#: One server-sent event of a stream (OpenAPI 3.1 describes each event): a chunk, an error in OpenAI's shape when
#: the generation fails midway, then ``[DONE]``.
STREAM_EVENT = {"type": "object", "required": ["data"], "properties": {
    "id": {"type": "string", "description": "`<completion id>:<position>`, the `Last-Event-ID` to resume after "
                                            "this event (absent on `[DONE]`, and with `kns-event-ids: off`)."},
    "data": {"anyOf": [
        {"const": "[DONE]"},
        {"type": "string", "contentMediaType": "application/json",
         "contentSchema": {"anyOf": [openapi_schema(ChatCompletionChunk), openapi_schema(ErrorResponse)]}},
    ]},
}}
#: OpenAI's rate-limit headers, on every answer of an admitted request and on its 429
RATE_HEADERS = {name: {"description": text, "schema": {"type": "string"}} for name, text in (
    ("x-ratelimit-limit-requests", "Requests per minute allowed (the tighter of the key's and its org's)."),
    ("x-ratelimit-remaining-requests", "Requests left in the current minute."),
    ("x-ratelimit-reset-requests", "When the requests limit is whole again, e.g. `1s`, `6m0s`."),
    ("x-ratelimit-limit-tokens", "Tokens per minute allowed (prompt + max_tokens reserved per request)."),
    ("x-ratelimit-remaining-tokens", "Tokens left in the current minute."),
    ("x-ratelimit-reset-tokens", "When the tokens limit is whole again."),
)}
RETRY_HEADERS = {
    "retry-after": {"description": "Seconds to wait before retrying.", "schema": {"type": "string"}},
    "retry-after-ms": {"description": "The same, in milliseconds.", "schema": {"type": "string"}},
}
#: what a created completion's id leads to, streamed or not (its stored copy with ``store: true``)
CREATED_LINKS = links(
    GetChatCompletion=("getChatCompletion", {"completion_id": CREATED_ID}),
    ResumeChatCompletionStream=("getChatCompletion", {"completion_id": CREATED_ID, "stream": True}),
    GetChatCompletionMessages=("getChatCompletionMessages", {"completion_id": CREATED_ID}),
    CancelChatCompletion=("cancelChatCompletion", {"completion_id": CREATED_ID}),
    DeleteChatCompletion=("deleteChatCompletion", {"completion_id": CREATED_ID}),
)
RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"headers": {**REQUEST_ID_HEADER, **RATE_HEADERS}, "model": ChatCompletion,
          "description": "The completion: a `chat.completion` object, or with `stream: true` server-sent "
                         "`chat.completion.chunk` events ending with `data: [DONE]`.",
          "content": {"text/event-stream": {"schema": STREAM_EVENT}}, **CREATED_LINKS},
    **error_responses({
        400: "Invalid request: a malformed body, an invalid or unsupported parameter, an unrecognized argument, "
             "a prompt or completion beyond the context, or a prompt refused by the content filter.",
        401: "No API key, or an unknown one.",
        403: "The API key is suspended.",
        404: "The model does not exist.",
        413: "The request body is larger than the gateway accepts.",
        429: "A rate limit of the key or its organization was reached (`rate_limit_exceeded`: requests or tokens per "
             "minute, or requests in flight); `Retry-After` says when to retry, unless the request alone exceeds "
             "the limit.",
        500: "An unexpected error in the gateway.",
        502: "The generation failed behind the gateway.",
        503: "A backing service is unavailable, the gateway is stopping, or the request waited past its queue "
             "deadline; nothing was billed, retry later.",
        504: "No token arrived in time; the generation was cancelled.",
    }),
}
RESPONSES[429]["headers"] = {**RATE_HEADERS, **RETRY_HEADERS}


def parse_json(raw: bytes, model: type[Body]) -> Body:
    """A request body in our error shape (FastAPI's own validation answers in its own)."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"We could not parse the JSON body of your request: {exc}", code="invalid_json") from exc
    if not isinstance(data, dict):
        raise bad_request("The request body must be a JSON object.", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation(exc) from exc


def parse_body(raw: bytes) -> ChatCompletionRequest:
    return parse_json(raw, ChatCompletionRequest)


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_answered(request: Request, answering: Coroutine[Any, Any, Answer]) -> Answer | None:
    """The answer of a non-streaming request; None when its client hung up first (the answer is cancelled, which
    cancels its generation)."""
    answer = asyncio.ensure_future(answering)
    gone = asyncio.ensure_future(_until_disconnect(request))
    await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
    if not answer.done():
        answer.cancel()
        await asyncio.gather(answer, return_exceptions=True)
        return None
    gone.cancel()
    return answer.result()


@router.post("/v1/chat/completions", response_model=None, responses=RESPONSES, openapi_extra=OPENAPI_BODY,
             dependencies=[Depends(bearer)], operation_id="createChatCompletion")
async def chat_completions(request: Request, ctx: Context, key: Caller) -> Response:
    last_event_id = request.headers.get("last-event-id")
    if last_event_id is not None:
        # A client reconnecting to a stream (its body is the original request's): the rest of that stream.
        request_id, position = _last_event(last_event_id)
        return await _resume(request, ctx, key, request_id, position)
    ctx.chat.refuse_early(key)  # a throttled key: 429 before its body is even parsed
    body = parse_body(await request.body())
    # Checked on every request before admission (/openapi.json declares it on the operation); streams use it
    event_ids = _event_ids(request)
    traceparent = child_of(request.headers.get("traceparent"))
    accepted = await ctx.chat.accept(
        body, key, client_addr=request.client.host if request.client else None, traceparent=traceparent
    )
    headers = {"x-request-id": accepted.request_id, "traceparent": traceparent,
               **(accepted.ticket.headers() if accepted.ticket else {})}
    if body.stream:
        if event_ids is None:
            event_ids = ctx.settings.gateway.sse_event_ids
        return EventStreamResponse(ctx.chat.stream(accepted, event_ids=event_ids),
                                   headers={**headers, "cache-control": "no-cache"})
    # Non-streaming: a client that hangs up must still cancel the generation.
    try:
        result = await until_answered(request, ctx.chat.complete(accepted))
    except ApiError as exc:  # an admitted request's error answer carries its rate-limit headers too
        exc.headers = {**headers, **(exc.headers or {})}
        raise
    if result is None:
        return Response(status_code=499)
    return JSONResponse(result, headers=headers)


def _event_ids(request: Request) -> bool | None:
    """The ``kns-event-ids`` header's switch; None when it is absent (the gateway's default)."""
    value = request.headers.get(EVENT_IDS_HEADER)
    if value is None:
        return None
    switch = _SWITCH.get(value.strip().lower())
    if switch is None:
        raise bad_request(f"The {EVENT_IDS_HEADER} header must be 'on' or 'off', not '{value[:50]}'.",
                          param=EVENT_IDS_HEADER, code="invalid_header")
    return switch


def _last_event(value: str) -> tuple[str, int]:
    parsed = parse_event_id(value)
    if parsed is None:
        raise bad_request(f"The Last-Event-ID header '{value[:200]}' is not an event id of this API "
                          "(`<completion id>:<position>`, as sent in each event's `id:` field).",
                          param="Last-Event-ID", code="invalid_last_event_id")
    return parsed


async def _resume(request: Request, ctx: Context, key: Caller, request_id: str, client_has: int) -> Response:
    traceparent = child_of(request.headers.get("traceparent"))
    accepted = await ctx.chat.resume(request_id, client_has, key, traceparent=traceparent)
    return EventStreamResponse(ctx.chat.stream(accepted),
                               headers={"x-request-id": request_id, "traceparent": traceparent,
                                        "cache-control": "no-cache"})


@router.get("/v1/chat/completions/{completion_id}", response_model=None, dependencies=[Depends(bearer)],
            operation_id="getChatCompletion",
            responses={200: {"description": "A stored completion (`store: true`) as a `chat.completion` object; with "
                                            "`stream=true`: the rest of the completion's stream, as server-sent "
                                            "events after the one named by `Last-Event-ID` or `starting_after` "
                                            "(neither: all of it), within its resume window.",
                             "model": ChatCompletion,
                             "content": {"text/event-stream": {"schema": STREAM_EVENT}}},
                       **error_responses({400: "A malformed `Last-Event-ID` or `starting_after`.",
                                          401: "No API key, or an unknown one.",
                                          404: "No such stored completion, or stream: unknown, another "
                                               "organization's, deleted, or past its resume window.",
                                          503: "Stored completions or the stream registry are unavailable."}),
                       **READ_LIMITED})
async def get_chat_completion(
    completion_id: str, request: Request, ctx: Context, key: Caller,
    stream: bool = False,
    starting_after: int | None = Query(default=None, ge=-1, le=999_999_999,
                                       description="The position of the last event the client has."),
) -> Response:
    if not stream:
        return JSONResponse(await ctx.stored.get(completion_id, key.org_id))
    client_has = -1 if starting_after is None else starting_after
    last_event_id = request.headers.get("last-event-id")
    if last_event_id is not None:
        named, client_has = _last_event(last_event_id)
        if named != completion_id:
            raise bad_request("The Last-Event-ID header names another completion than the path.",
                              param="Last-Event-ID", code="invalid_last_event_id")
    return await _resume(request, ctx, key, completion_id, client_has)


@router.post("/v1/chat/completions/{completion_id}/cancel", response_model=None, dependencies=[Depends(bearer)],
             operation_id="cancelChatCompletion",
             responses={200: {"description": "The cancel is on its way: the worker generating the completion stops "
                                            "within one engine step, wherever it runs. Billed for what reached its "
                                            "clients: every token emitted while a client is attached to its "
                                            "stream, else what the last one received. Ours: OpenAI has no such "
                                            "endpoint for chat completions."},
                        **error_responses({401: "No API key, or an unknown one.",
                                           404: "No such completion: unknown, another organization's, or past its "
                                                "resume window.",
                                           409: "The completion has already ended.",
                                           503: "The stream registry or the control topic is unavailable; retry."})})
async def cancel_chat_completion(completion_id: str, request: Request, ctx: Context, key: Caller) -> JSONResponse:
    await ctx.chat.cancel_stream(completion_id, key, traceparent=child_of(request.headers.get("traceparent")))
    return JSONResponse({"id": completion_id, "object": "chat.completion.cancellation", "status": "cancelling"})
