"""A minimal streaming client for capacity tests: an asyncio protocol per connection, SSE events split on bytes.

At hundreds of concurrent streams a general HTTP client spends more CPU than the server it measures (on a 2-core
machine that hides the server's limit); so did asyncio's stream reader here (three awaits per chunk: 20 µs a
chunk). This client only timestamps content events as their bytes arrive and parses JSON once, for the usage
chunk. Same per-request figures as ``bench.loadgen`` (TTFT, inter-token gaps, end-to-end, tokens).
"""

from __future__ import annotations

import asyncio
import time
from typing import cast
from urllib.parse import urlparse

import orjson

from bench.loadgen import RequestResult


class _Stream(asyncio.Protocol):
    """One request's connection: timestamps each read's content events as the bytes arrive, no stream reader.

    The chunked framing is not decoded: events are split on their blank line, and a chunk's size line only ever
    sits in front of an event (JSON-encoded text has no raw newline), so the checks below see through it."""

    def __init__(self, request: bytes, result: RequestResult, started: float) -> None:
        self._request = request
        self.result = result
        self._started = started
        self._last: float | None = None
        self._head: bytes | None = b""  # None once the status line and headers are in
        self._pending = b""
        self._body = b""  # a refusal's body (the first 400 bytes)
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # a TCP transport (uvloop's is no subclass of asyncio's classes: no isinstance here)
        cast(asyncio.WriteTransport, transport).write(self._request)

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        if self._head is not None:
            head, sep, data = (self._head + data).partition(b"\r\n\r\n")
            if not sep:
                self._head = head
                return
            self._head = None
            self.result.status = int(head.split(b" ", 2)[1])
        if self.result.status != 200:
            self._body = (self._body + data)[:400]
            return
        *events, self._pending = (self._pending + data).split(b"\n\n")
        for event in events:
            self._event(event, now)

    def _event(self, event: bytes, now: float) -> None:
        result = self.result
        if b'"content":"' in event and b'"content":""' not in event:
            start = event.index(b'"content":"') + 11
            end = event.index(b'"', start)
            while event[end - 1] == 0x5C:  # an escaped quote belongs to the text
                end = event.index(b'"', end + 1)
            result.content_bytes += end - start
            if self._last is None:
                result.ttft = now - self._started
            else:
                result.itl.append(now - self._last)
            self._last = now
        elif b"data: [DONE]" in event:
            result.ok = result.error is None  # a failed stream ends with its error event, then [DONE] all the same
        elif b'"error":{' in event:  # the gateway's error event (a text's quotes are escaped: never this)
            error = orjson.loads(event[event.index(b"data: ") + 6:])["error"]
            result.error = f"{error.get('code')}: {error.get('message')}"
        elif b'"usage":{' in event:
            result.output_tokens = orjson.loads(event[event.index(b"data: ") + 6:])["usage"]["completion_tokens"]

    def connection_lost(self, exc: Exception | None) -> None:
        result = self.result
        result.e2e = time.perf_counter() - self._started
        if exc is not None:
            result.error = f"{type(exc).__name__}: {exc}"
        elif result.status is not None and result.status != 200:
            result.error = self._body.decode(errors="replace")
        elif not result.ok and result.error is None:
            result.error = "stream ended without [DONE]"
        if not self.closed.done():
            self.closed.set_result(None)


async def stream(base_url: str, api_key: str, body: dict[str, object], index: int, run_start: float
                 ) -> RequestResult:
    url = urlparse(base_url)
    payload = orjson.dumps(body)
    started = time.perf_counter()
    result = RequestResult(index, ok=False, started_at=started - run_start)
    request = (f"POST {url.path}/chat/completions HTTP/1.1\r\nHost: {url.netloc}\r\n"
               f"Authorization: Bearer {api_key}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n").encode() + payload
    loop = asyncio.get_running_loop()
    try:
        transport, protocol = await loop.create_connection(lambda: _Stream(request, result, started),
                                                           url.hostname or "127.0.0.1", url.port or 80)
    except OSError as exc:
        result.error = f"connect: {exc}"
        return result
    try:
        await protocol.closed
    finally:
        transport.close()
    return result


async def streams(base_url: str, api_key: str, model: str, n: int, tokens: int, ramp_s: float = 0.0
                  ) -> tuple[list[RequestResult], float]:
    """``n`` concurrent streams of ``tokens`` tokens each, started evenly over ``ramp_s`` (0: all at once);
    (results, wall seconds)."""
    run_start = time.perf_counter()
    body = {"model": model, "messages": [{"role": "user", "content": "Go."}], "max_tokens": tokens,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}

    async def started(i: int) -> RequestResult:
        await asyncio.sleep(ramp_s * i / n)
        return await stream(base_url, api_key, body, i, run_start)

    results = await asyncio.gather(*(started(i) for i in range(n)))
    return list(results), time.perf_counter() - run_start


def main() -> None:
    """``python -m bench.sse_client URL KEY MODEL STREAMS TOKENS RAMP_S``: the clients as a process of their own
    (pinned to other cores than the server's), results as JSON on stdout."""
    import dataclasses
    import sys

    import uvloop

    url, key, model, n, tokens, ramp = sys.argv[1:7]
    results, wall = uvloop.run(streams(url, key, model, int(n), int(tokens), float(ramp)))
    sys.stdout.buffer.write(orjson.dumps({"wall_s": wall, "cpu_s": time.process_time(),
                                          "results": [dataclasses.asdict(r) for r in results]}))


if __name__ == "__main__":
    main()
