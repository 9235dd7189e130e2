"""The SSE response of every stream the gateway serves: Starlette's ``StreamingResponse`` without its anyio task group.

A gateway holds thousands of idle streams, and every object a stream keeps alive is walked by each full garbage
collection, which stops the event loop (``kns_gc_pause_seconds``; at 10,000 held streams, the TTFT tail). Starlette
runs each response in a task group of two tasks (the body, and a listener for the client's disconnect) with anyio's
cancel scopes, task states, events and closures: about a third of what a held stream keeps. Here the body runs in
the request's own task and one plain task listens for the disconnect, then cancels it; the body iterator sees the
cancellation where it waits (its ``finally`` runs: the generation is cancelled, a background response detached),
exactly as under the task group, and the response ends normally as Starlette's does.
"""

from __future__ import annotations

import asyncio

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


class EventStreamResponse(StreamingResponse):
    media_type = "text/event-stream"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        streaming = asyncio.current_task()
        if streaming is None or scope["type"] != "http":  # not under a task: no one to cancel (never in uvicorn)
            await super().__call__(scope, receive, send)
            return
        gone: list[bool] = []
        listener = asyncio.get_running_loop().create_task(_client_left(receive, streaming, gone))
        try:
            await self.stream_response(send)
        except asyncio.CancelledError:
            # Swallowed only when the listener asked for it and nobody else did (a server stopping cancels too).
            if not gone or streaming.uncancel() > 0:
                raise
        finally:
            listener.cancel()
        if self.background is not None:
            await self.background()


async def _client_left(receive: Receive, streaming: asyncio.Task[object], gone: list[bool]) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    gone.append(True)
    streaming.cancel()
