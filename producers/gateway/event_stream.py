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
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


class EventStreamResponse(StreamingResponse):
    media_type = "text/event-stream"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        streaming = asyncio.current_task()
        if streaming is None or scope["type"] != "http":  # not under a task: no one to cancel (never in uvicorn)
            await super().__call__(scope, receive, send)
            return
        watch = _Disconnect(streaming)
        listener = asyncio.get_running_loop().create_task(watch.listen(receive))
        try:
            await self.stream_response(send)
        except asyncio.CancelledError:
            # Swallowed only when the listener cancelled and nobody else did (a server stopping cancels too).
            if not watch.cancelled or streaming.uncancel() > 0:
                raise
        finally:
            listener.cancel()
            if watch.pending is not None:
                watch.pending.cancel()
        if watch.error is not None:  # as Starlette's task group: the listener's error ends the response
            raise watch.error
        if self.background is not None:
            await self.background()


class _Disconnect:
    """Listens for the client leaving, then cancels the request's task."""

    __slots__ = ("_streaming", "cancelled", "error", "pending")

    def __init__(self, streaming: asyncio.Task[Any]) -> None:
        self._streaming = streaming
        self.error: Exception | None = None
        self.pending: asyncio.Handle | None = None
        self.cancelled = False

    async def listen(self, receive: Receive) -> None:
        try:
            while (await receive())["type"] != "http.disconnect":
                pass
        except Exception as exc:  # BodySizeLimit's 413, reading a resume's unread body: not lost with this task
            self.error = exc
        # A step later, as anyio cancels: a wait of the body's that has just ended (a paused write that a lost
        # connection resumes) ends as it would, and the cancellation lands on its next wait, inside the body
        # iterator, whose ``finally`` then runs (cancelled in ``send``, an iterator not started yet never runs it).
        self.pending = asyncio.get_running_loop().call_soon(self._cancel)

    def _cancel(self) -> None:
        self.pending, self.cancelled = None, True
        self._streaming.cancel()
