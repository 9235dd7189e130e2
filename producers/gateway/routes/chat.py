"""``POST /v1/chat/completions``: a thin adapter from HTTP to :class:`ChatService`."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from producers.gateway.deps import Caller, Context
from producers.gateway.errors import bad_request, from_validation
from producers.gateway.protocol import ChatCompletionRequest
from runtime.tracing import child_of

router = APIRouter()
log = logging.getLogger(__name__)


def parse_body(raw: bytes) -> ChatCompletionRequest:
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"We could not parse the JSON body of your request: {exc}", code="invalid_json") from exc
    if not isinstance(data, dict):
        raise bad_request("The request body must be a JSON object.", code="invalid_json")
    try:
        return ChatCompletionRequest.model_validate(data)
    except ValidationError as exc:
        raise from_validation(exc) from exc


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(request: Request, ctx: Context, key: Caller) -> Response:
    body = parse_body(await request.body())
    if ctx.settings.gateway.log_unknown_fields and body.unknown_fields():
        log.info("unknown request fields ignored", extra={"fields": body.unknown_fields()})
    traceparent = child_of(request.headers.get("traceparent"))
    accepted = await ctx.chat.accept(
        body, key, client_addr=request.client.host if request.client else None, traceparent=traceparent
    )
    headers = {"x-request-id": accepted.request_id, "traceparent": traceparent}
    if body.stream:
        return StreamingResponse(ctx.chat.stream(accepted), media_type="text/event-stream",
                                 headers={**headers, "cache-control": "no-cache"})
    # Non-streaming: a client that hangs up must still cancel the generation.
    answer = asyncio.ensure_future(ctx.chat.complete(accepted))
    gone = asyncio.ensure_future(_until_disconnect(request))
    await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
    if not answer.done():
        answer.cancel()
        await asyncio.gather(answer, return_exceptions=True)
        return Response(status_code=499)
    gone.cancel()
    result: dict[str, Any] = answer.result()
    return JSONResponse(result, headers=headers)
