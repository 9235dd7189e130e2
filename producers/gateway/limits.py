"""Request body size limit, as raw ASGI middleware: oversize bodies get a 413 before any parsing."""

from __future__ import annotations

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from producers.gateway.errors import ApiError


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"Request body too large: the limit is {limit} bytes.", code="request_too_large")


class BodySizeLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                await self._reject(send)
                return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    # Raised inside the route's body read; the ApiError handler answers 413.
                    raise _too_large(self.max_bytes)
            return message

        await self.app(scope, counted, send)

    async def _reject(self, send: Send) -> None:
        error = _too_large(self.max_bytes)
        body = orjson.dumps(error.body())
        await send({"type": "http.response.start", "status": error.status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
