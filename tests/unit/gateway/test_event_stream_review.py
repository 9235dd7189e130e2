"""Review of the gateway's SSE response against Starlette's ``StreamingResponse`` (the reference it replaces), with a
fake server whose ``receive``/``send`` behave as uvicorn's httptools cycle does (ASGI spec 2.3): ``receive`` waits on
one event that both a disconnect and the response's completion set, and returns ``http.disconnect`` after either;
``send`` waits while writing is paused, and returns without writing once the client is gone."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from starlette.responses import StreamingResponse

from producers.gateway.event_stream import EventStreamResponse
from tests.fakes.sse_bodies import Body, tasks_now

SCOPE = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "method": "POST", "path": "/"}
BOTH = [StreamingResponse, EventStreamResponse]


class Cycle:
    """uvicorn's RequestResponseCycle, reduced to what a response sees of it."""

    def __init__(self, body_chunks: list[bytes] | None = None) -> None:
        self.message_event = asyncio.Event()
        self.writable = asyncio.Event()
        self.writable.set()
        self.disconnected = self.response_complete = False
        self.pending = list(body_chunks or [])  # a request body nobody has read yet (a resume POST's)
        if self.pending:
            self.message_event.set()
        self.written: list[bytes] = []

    async def receive(self) -> dict[str, Any]:
        if not self.disconnected and not self.response_complete:
            await self.message_event.wait()
            self.message_event.clear()
        if self.disconnected or self.response_complete:
            return {"type": "http.disconnect"}
        body = self.pending.pop(0) if self.pending else b""
        if self.pending:
            self.message_event.set()
        return {"type": "http.request", "body": body, "more_body": bool(self.pending)}

    async def send(self, message: dict[str, Any]) -> None:
        if not self.writable.is_set() and not self.disconnected:
            await self.writable.wait()  # flow.drain()
        if self.disconnected:
            return
        if message["type"] == "http.response.body":
            self.written.append(message.get("body", b""))
            if not message.get("more_body", False):
                self.response_complete = True
                self.message_event.set()

    def connection_lost(self) -> None:
        self.disconnected = True
        self.message_event.set()
        self.writable.set()  # flow.resume_writing()




class TooLarge(Exception):
    """What the gateway's BodySizeLimit raises from ``receive`` when a request body passes the limit."""


@pytest.mark.parametrize("response_class", BOTH)
async def test_a_receive_that_fails_ends_the_stream_with_its_error_as_starlette_does(response_class: type) -> None:
    """A resume ``POST`` (``Last-Event-ID``) is answered without reading its body: the disconnect listener reads it,
    through BodySizeLimit's ``receive``, which raises (413) once a chunked body passes the limit. Under Starlette's
    task group that error cancels the body (its ``finally`` cancels the generation) and ends the response. A
    listener task that dies of it silently must not leave the stream running with nobody listening for the
    client's disconnect (and an exception nobody retrieves)."""
    cycle, body = Cycle([b"x" * 10, b"x" * 10]), Body([b"data: a\n\n"])
    seen = 0

    async def counted() -> dict[str, Any]:
        nonlocal seen
        message = await cycle.receive()
        if message["type"] == "http.request":
            seen += len(message["body"])
            if seen > 15:
                raise TooLarge
        return message

    before = tasks_now()
    serving = asyncio.ensure_future(response_class(body.__aiter__())(SCOPE, counted, cycle.send))
    try:
        with pytest.raises(TooLarge):
            await asyncio.wait_for(asyncio.shield(serving), 2)
    finally:
        if not serving.done():  # the stream went on, deaf to its client: stop it for the next tests
            serving.cancel()
            await asyncio.gather(serving, return_exceptions=True)
    assert body.ended_by == "cancelled"
    await asyncio.sleep(0)
    assert tasks_now() == before


@pytest.mark.parametrize("response_class", BOTH)
async def test_a_client_that_leaves_while_a_write_waits_still_ends_the_body(response_class: type) -> None:
    """Writing paused (a slow reader), then the connection lost: uvicorn wakes the listener before the write, so the
    cancellation lands in ``send``, with the body suspended at its ``yield``; its ``finally`` must still run."""
    cycle, body = Cycle(), Body([b"data: a\n\n", b"data: b\n\n"])
    cycle.writable.clear()
    serving = asyncio.ensure_future(response_class(body.__aiter__())(SCOPE, cycle.receive, cycle.send))
    for _ in range(5):
        await asyncio.sleep(0)
    cycle.connection_lost()
    await asyncio.wait_for(serving, 2)
    for _ in range(5):  # an unfinished async generator is closed by the loop's finalizer, a step later
        await asyncio.sleep(0)
    assert body.ended_by in ("cancelled", "closed")


@pytest.mark.parametrize("response_class", BOTH)
async def test_the_response_completing_is_not_taken_for_a_client_that_left(response_class: type) -> None:
    """uvicorn's ``receive`` answers ``http.disconnect`` as soon as the last body message is sent, and here the
    connection is lost in the same instant: the listener woken by either must be stopped before it cancels anything;
    the response ends normally, its body ended by itself."""
    cycle, body = Cycle(), Body([b"data: a\n\n", b"data: [DONE]\n\n"], then_wait=False)

    async def send(message: dict[str, Any]) -> None:
        await cycle.send(message)
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            cycle.connection_lost()

    before = tasks_now()
    serving = asyncio.ensure_future(response_class(body.__aiter__())(SCOPE, cycle.receive, send))
    await asyncio.wait_for(serving, 2)
    assert body.ended_by == "end" and cycle.response_complete
    assert b"".join(cycle.written) == b"data: a\n\ndata: [DONE]\n\n"
    assert not serving.cancelled() and serving.cancelling() == 0
    await asyncio.sleep(0)
    assert tasks_now() == before
