"""Review of ``kns bench relay --source tokens`` (helper; fixed in bench/sse_client.py): what the capacity clients
count as a completed stream.

The gateway ends a failed stream with an error event and then ``data: [DONE]`` (``GatewayService.stream``:
``generation_failed(delta).body()``, then ``DONE``). The client takes ``[DONE]`` alone for a proper end, so such a
stream is ``ok``: it counts in ``completed`` (the level's ``ok`` asks ``completed == n``), its TTFT and gaps count
in the percentiles, and one that failed before its first token (``stream_timeout``, ``queue_deadline_exceeded``)
is left out of TTFT altogether (``ttft`` None) while counting as completed.

The bytes served below are the gateway's own (``ChunkFormatter``, ``generation_failed``), HTTP/1.1 chunked as
uvicorn writes them (one chunk per event).
"""

from __future__ import annotations

import asyncio

from bench.loadgen import RequestResult, Target, plan
from bench.workload import Shape
from producers.gateway.service import generation_failed
from producers.relay.collector import Delta
from producers.relay.sse import DONE, ChunkFormatter
from schemas.events import ErrorCode


def _http(events: list[bytes]) -> bytes:
    return (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
            + b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n")


async def _stream(response: bytes) -> RequestResult:
    from bench.sse_client import stream

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(response)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        return await asyncio.wait_for(stream(f"http://127.0.0.1:{port}/v1", "k", {"model": "m"}, 0, 0.0), 10)
    finally:
        server.close()


def _failed(code: str, error: str, position: int, fmt: ChunkFormatter) -> bytes:
    delta = Delta(finish_reason="error", error=error, error_code=code, position=position)
    return fmt.frame(generation_failed(delta).body(), position + 1)


async def test_a_stream_the_gateway_ended_with_an_error_event_is_not_a_completed_stream() -> None:
    """Two tokens, then the gateway's error event (the stream lost a delta: ``stream_inconsistent``), then
    ``[DONE]``: the stream did not end properly, whatever ``[DONE]`` says."""
    fmt = ChunkFormatter("req-1", "m", 0, include_usage=True)
    events = [fmt.role(), fmt.content(" tok", 1), fmt.content(" tok", 2),
              _failed(ErrorCode.STREAM_INCONSISTENT.value, "a token event was lost", 2, fmt), DONE]
    result = await _stream(_http(events))
    assert result.ttft is not None and len(result.itl) == 1  # the two tokens were seen
    assert not result.ok, result
    assert result.error is not None, result


async def test_a_stream_that_failed_before_its_first_token_is_neither_completed_nor_dropped_from_ttft() -> None:
    """A stream that got no token (``stream_timeout``: no worker produced a first token in time) and one that
    streamed normally: the level's summary must not say both completed, with a TTFT p99 from the good one alone."""
    fmt = ChunkFormatter("req-2", "m", 0, include_usage=True)
    timed_out = await _stream(_http([
        fmt.role(), _failed(ErrorCode.STREAM_TIMEOUT.value, "no worker produced a first token within 40 s", 0, fmt),
        DONE]))
    ok_fmt = ChunkFormatter("req-3", "m", 0, include_usage=True)
    good = await _stream(_http([
        ok_fmt.role(), ok_fmt.content(" tok", 1), ok_fmt.content(" tok", 2), ok_fmt.finish("length", 3),
        ok_fmt.usage({"prompt_tokens": 8, "completion_tokens": 2, "total_tokens": 10}, 4), DONE]))
    assert good.ok and good.output_tokens == 2, good
    assert timed_out.ttft is None  # nothing to time: it must then not pass for a completed stream

    run = plan(Target("http://127.0.0.1:1/v1", "m", "k"), Shape("fixed", 2, 8, 2), concurrency=2)
    good.index, timed_out.index = 0, 1
    run.results, run.wall_s = [good, timed_out], 1.0
    summary = run.summary()
    assert summary["completed"] == 1, summary
