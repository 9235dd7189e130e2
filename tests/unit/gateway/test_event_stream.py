"""The gateway's SSE response (pure ASGI logic: a fake receive and send): it streams as Starlette's does, a client
that leaves cancels the body where it waits and the response ends normally, a server's own cancellation and the
body's exceptions still propagate, and nothing it started outlives it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from producers.gateway.event_stream import EventStreamResponse
from tests.fakes.sse_bodies import Body, tasks_now

SCOPE = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "method": "GET", "path": "/"}


class Client:
    """The server's side of one connection: what was sent, and a disconnect to trigger."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self._left = asyncio.Event()

    async def receive(self) -> dict[str, Any]:
        await self._left.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)

    def leave(self) -> None:
        self._left.set()

    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.sent if m["type"] == "http.response.body")




async def test_it_streams_the_events_and_ends_the_body_as_starlette_does() -> None:
    client, body = Client(), Body([b"data: a\n\n", b"data: b\n\n"], then_wait=False)
    before = tasks_now()
    await EventStreamResponse(body.__aiter__(), headers={"x-request-id": "r"})(SCOPE, client.receive, client.send)
    start = client.sent[0]
    assert start["type"] == "http.response.start" and start["status"] == 200
    assert (b"content-type", b"text/event-stream; charset=utf-8") in start["headers"]
    assert (b"x-request-id", b"r") in start["headers"]
    assert client.body() == b"data: a\n\ndata: b\n\n"
    assert client.sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    assert body.ended_by == "end"
    await asyncio.sleep(0)
    assert tasks_now() == before  # the disconnect listener is gone


async def test_a_client_that_leaves_cancels_the_body_where_it_waits_and_the_response_ends_normally() -> None:
    client, body = Client(), Body([b"data: a\n\n"], then_wait=True)
    before = tasks_now()
    serving = asyncio.create_task(EventStreamResponse(body.__aiter__())(SCOPE, client.receive, client.send))
    await body.waiting.wait()
    client.leave()
    await asyncio.wait_for(serving, 5)  # returns: no CancelledError out of the app (uvicorn would log it)
    assert body.ended_by == "cancelled"  # the body's finally ran: the service cancels the generation there
    assert not serving.cancelled() and serving.cancelling() == 0
    await asyncio.sleep(0)
    assert tasks_now() == before


async def test_a_server_that_cancels_the_request_still_cancels_it() -> None:
    """The server stopping (or its own timeout) cancels the request's task: that is not a client leaving, and must
    not be swallowed, even when the client left at the same moment."""
    for client_leaves_too in (False, True):
        client, body = Client(), Body([], then_wait=True)
        serving = asyncio.create_task(EventStreamResponse(body.__aiter__())(SCOPE, client.receive, client.send))
        await body.waiting.wait()
        if client_leaves_too:
            client.leave()
        serving.cancel()
        with pytest.raises(asyncio.CancelledError):
            await serving
        assert body.ended_by == "cancelled"


async def test_an_exception_of_the_body_propagates_and_the_listener_is_stopped() -> None:
    class Stopping(Exception):
        pass

    async def body() -> AsyncIterator[bytes]:
        yield b"data: a\n\n"
        raise Stopping  # as HandedOver: the connection is closed for the client to resume elsewhere

    client = Client()
    before = tasks_now()
    with pytest.raises(Stopping):
        await EventStreamResponse(body())(SCOPE, client.receive, client.send)
    await asyncio.sleep(0)
    assert tasks_now() == before
