"""A minimal streaming client for capacity tests: raw asyncio streams, HTTP/1.1 chunked decoding, SSE lines.

At hundreds of concurrent streams a general HTTP client spends more CPU than the server it measures (on a 2-core
machine that hides the server's limit). This client only timestamps content chunks and parses JSON once, for the
usage chunk. Same per-request figures as ``bench.loadgen`` (TTFT, inter-token gaps, end-to-end, tokens).
"""

from __future__ import annotations

import asyncio
import time
from urllib.parse import urlparse

import orjson

from bench.loadgen import RequestResult


async def _read_chunk(reader: asyncio.StreamReader) -> bytes:
    size = int((await reader.readline()).strip() or b"0", 16)
    if size == 0:
        await reader.readline()
        return b""
    data = await reader.readexactly(size)
    await reader.readexactly(2)
    return data


async def stream(base_url: str, api_key: str, body: dict[str, object], index: int, run_start: float
                 ) -> RequestResult:
    url = urlparse(base_url)
    payload = orjson.dumps(body)
    started = time.perf_counter()
    result = RequestResult(index, ok=False, started_at=started - run_start)
    try:
        reader, writer = await asyncio.open_connection(url.hostname, url.port)
    except OSError as exc:
        result.error = f"connect: {exc}"
        return result
    try:
        writer.write(
            f"POST {url.path}/chat/completions HTTP/1.1\r\nHost: {url.netloc}\r\nAuthorization: Bearer {api_key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode()
            + payload)
        status_line = await reader.readline()
        result.status = int(status_line.split()[1])
        chunked = False
        while (line := await reader.readline()) not in (b"\r\n", b""):
            if line.lower().startswith(b"transfer-encoding:") and b"chunked" in line.lower():
                chunked = True
        if result.status != 200:
            result.error = (await reader.read(400)).decode(errors="replace")
            return result
        last: float | None = None
        pending = b""
        while True:
            data = await (_read_chunk(reader) if chunked else reader.read(65536))
            if not data:
                break
            pending += data
            *events, pending = pending.split(b"\n\n")
            for event in events:
                if event.startswith(b"id: "):  # every event but [DONE] carries its resume id first
                    event = event.partition(b"\n")[2]
                if not event.startswith(b"data: "):
                    continue
                if event == b"data: [DONE]":
                    result.ok = True
                elif b'"content":"' in event and b'"content":""' not in event:
                    now = time.perf_counter()
                    if last is None:
                        result.ttft = now - started
                    else:
                        result.itl.append(now - last)
                    last = now
                elif b'"usage":{' in event:
                    usage = orjson.loads(event[6:])["usage"]
                    result.output_tokens = usage["completion_tokens"]
        result.e2e = time.perf_counter() - started
        if not result.ok:
            result.error = "stream ended without [DONE]"
    except (OSError, asyncio.IncompleteReadError, ValueError, IndexError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        writer.close()
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
