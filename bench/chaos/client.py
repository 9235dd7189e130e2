"""The chaos load: streaming chat completions that keep everything needed to audit them afterwards.

Unlike the benchmark load generator, each request keeps its whole received text, the time of every content
chunk (to measure how long a fault silenced it), and exactly how it ended: finished, an error with its code (an
HTTP status or an SSE error event), or a broken connection.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
import orjson


@dataclass
class Stream:
    index: int
    prompt: str
    max_tokens: int
    request_id: str | None = None
    status: int | None = None
    #: stop / length / content_filter when the worker finished it
    finish_reason: str | None = None
    #: the OpenAI error code (or "connection: ...") when it failed
    error: str | None = None
    done: bool = False
    text: str = ""
    usage: dict[str, Any] | None = None
    started: float = 0.0
    ended: float = 0.0
    chunk_times: list[float] = field(default_factory=list)

    @property
    def completed(self) -> bool:
        return self.done and self.error is None and self.finish_reason in ("stop", "length")

    @property
    def outcome(self) -> str:
        if self.completed:
            return "completed"
        return self.error or ("no [DONE]" if not self.done else f"finish {self.finish_reason}")

    def longest_silence(self) -> float:
        """The longest gap between content chunks (or from the start to the first chunk)."""
        times = [self.started, *self.chunk_times]
        return max((b - a for a, b in itertools.pairwise(times)), default=0.0)

    def as_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["chunk_times"] = [round(t - self.started, 4) for t in self.chunk_times]
        return data


def body(stream: Stream, model: str, *, temperature: float, seed: int | None) -> bytes:
    payload: dict[str, Any] = {
        "model": model, "messages": [{"role": "user", "content": stream.prompt}], "max_tokens": stream.max_tokens,
        "temperature": temperature, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
    }
    if seed is not None:
        payload["seed"] = seed
    return orjson.dumps(payload)


async def run_stream(client: httpx.AsyncClient, stream: Stream, api_key: str, model: str, *, temperature: float,
                     seed: int | None, t0: float) -> Stream:
    stream.started = time.monotonic() - t0
    try:
        async with client.stream("POST", "/chat/completions", content=body(stream, model, temperature=temperature,
                                                                            seed=seed),
                                 headers={"Authorization": f"Bearer {api_key}",
                                          "Content-Type": "application/json"}) as response:
            stream.status = response.status_code
            if response.status_code != 200:
                error = orjson.loads(await response.aread()).get("error", {})
                stream.error = f"{response.status_code} {error.get('code')}"
                return stream
            async for line in response.aiter_lines():
                _take(stream, line, time.monotonic() - t0)
    except (httpx.HTTPError, orjson.JSONDecodeError) as exc:
        stream.error = stream.error or f"connection: {type(exc).__name__}"
    finally:
        stream.ended = time.monotonic() - t0
    return stream


def _take(stream: Stream, line: str, now: float) -> None:
    if not line.startswith("data: "):
        return
    if line == "data: [DONE]":
        stream.done = True
        return
    chunk = orjson.loads(line[6:])
    if "error" in chunk:
        stream.error = f"stream {chunk['error'].get('code')}"
        return
    stream.request_id = stream.request_id or chunk.get("id")
    if chunk.get("usage"):
        stream.usage = chunk["usage"]
    for choice in chunk.get("choices") or ():
        content = choice.get("delta", {}).get("content")
        if content:
            stream.text += content
            stream.chunk_times.append(now)
        if choice.get("finish_reason"):
            stream.finish_reason = choice["finish_reason"]


class Load:
    """``requests`` streams, ``concurrency`` at a time, started as soon as a slot frees."""

    def __init__(self, base_url: str, api_key: str, model: str, *, requests: int, concurrency: int,
                 max_tokens: int, label: str, temperature: float = 0.0, seed: int | None = None) -> None:
        self.base_url, self.api_key, self.model = base_url, api_key, model
        self.streams = [Stream(i, f"chaos {label} request {i}: tell me a story", max_tokens)
                        for i in range(requests)]
        self.concurrency = concurrency
        self.temperature, self.seed = temperature, seed
        self.t0 = time.monotonic()

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def more(self, n: int) -> None:
        """``n`` more streams, now, all at once (a scenario's second phase); they count with the others."""
        extra = [Stream(len(self.streams) + i, f"{self.streams[0].prompt} (after {i})", self.streams[0].max_tokens)
                 for i in range(n)]
        self.streams += extra
        async with httpx.AsyncClient(base_url=self.base_url, timeout=httpx.Timeout(600.0, connect=10.0)) as client:
            await asyncio.gather(*(run_stream(client, s, self.api_key, self.model, temperature=self.temperature,
                                              seed=self.seed, t0=self.t0) for s in extra))

    async def run(self, progress: Any = None) -> list[Stream]:
        limit = asyncio.Semaphore(self.concurrency)
        timeout = httpx.Timeout(600.0, connect=10.0)
        async with httpx.AsyncClient(base_url=self.base_url, timeout=timeout,
                                     limits=httpx.Limits(max_connections=self.concurrency + 4)) as client:

            async def one(stream: Stream) -> None:
                async with limit:
                    await run_stream(client, stream, self.api_key, self.model, temperature=self.temperature,
                                     seed=self.seed, t0=self.t0)
                    if progress is not None:
                        progress()

            await asyncio.gather(*(one(s) for s in list(self.streams)))
        return self.streams
