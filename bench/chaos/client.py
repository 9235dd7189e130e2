"""The chaos load: streaming chat completions that keep everything needed to audit them afterwards.

Unlike the benchmark load generator, each request keeps its whole received text, the time of every content
chunk (to measure how long a fault silenced it), and exactly how it ended: finished, an error with its code (an
HTTP status or an SSE error event), or a broken connection.

With several gateways the client does what an SDK retrying or a browser's ``EventSource`` does when a stream
breaks (its gateway died or stopped: the connection closed without ``[DONE]``): it reconnects to the next gateway
with the last event id it received (``Last-Event-ID``), or asks for the whole stream by its id when no event had
arrived yet, and counts the resume.

A stream can also be told to drop its own connection after some chunks (a phone losing its network): it then
comes back after a pause, as above, or never (``abandoned``, its outcome).
"""

from __future__ import annotations

import asyncio
import contextlib
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
    #: the gateway it is sent to first (an index into the load's gateways)
    gateway: int = 0
    temperature: float = 0.0
    seed: int | None = None
    #: a structured output: the JSON schema its answer is decoded under (None: free text)
    json_schema: dict[str, Any] | None = None
    #: the conversation it is a turn of (a load with conversations)
    conversation_id: str | None = None
    request_id: str | None = None
    last_event_id: str | None = None
    #: reconnections that continued the stream on another gateway, and each one's time without a connection
    resumes: int = 0
    resume_gaps: list[float] = field(default_factory=list)
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
    #: drop the connection once this many content chunks arrived (None: never), then come back after
    #: ``back_after_s`` or (None) never
    drop_after: int | None = None
    back_after_s: float | None = None
    #: when the client dropped its connection (Unix seconds), and whether it then gave up on the stream
    dropped_at: float | None = None
    abandoned: bool = False

    @property
    def completed(self) -> bool:
        return self.done and self.error is None and self.finish_reason in ("stop", "length")

    @property
    def refused(self) -> bool:
        """Answered with an error before it was accepted (no request id): nothing of it was generated."""
        return self.request_id is None and self.status is not None and self.status != 200

    @property
    def outcome(self) -> str:
        if self.completed:
            return "completed"
        if self.abandoned:
            return "abandoned"
        if self.refused:
            return f"refused {self.error}"
        return self.error or ("no [DONE]" if not self.done else f"finish {self.finish_reason}")

    def longest_silence(self) -> float:
        """The longest gap between content chunks (or from the start to the first chunk)."""
        times = [self.started, *self.chunk_times]
        return max((b - a for a, b in itertools.pairwise(times)), default=0.0)

    def as_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["chunk_times"] = [round(t - self.started, 4) for t in self.chunk_times]
        return data


#: a mixed load's structured output: an object whose one string is longer than any chaos answer's max_tokens, so that
#: it ends with ``length`` as the load's free-text streams do (counted by their request, not re-tokenized: a
#: grammar's token splits are not always the tokenizer's)
STORY: dict[str, Any] = {"type": "object", "properties": {"story": {"type": "string", "minLength": 2000}},
                         "required": ["story"], "additionalProperties": False}


def body(stream: Stream, model: str) -> bytes:
    payload: dict[str, Any] = {
        "model": model, "messages": [{"role": "user", "content": stream.prompt}], "max_tokens": stream.max_tokens,
        "temperature": stream.temperature, "stream": True, "stream_options": {"include_usage": True},
    }
    if stream.json_schema is None:
        payload["ignore_eos"] = True
    else:  # its grammar decides where it ends: STORY's length runs it to max_tokens, as ignore_eos would
        payload["response_format"] = {"type": "json_schema", "json_schema": {"name": "story",
                                                                             "schema": stream.json_schema}}
    if stream.seed is not None:
        payload["seed"] = stream.seed
    if stream.conversation_id is not None:
        payload["conversation_id"] = stream.conversation_id
    return orjson.dumps(payload)


#: reconnection attempts per stream (each to the next gateway), and the pause before each
MAX_RECONNECTS = 12
RECONNECT_PAUSE_S = 0.2


async def run_stream(clients: list[httpx.AsyncClient], stream: Stream, api_key: str, model: str, *,
                     t0: float) -> Stream:
    stream.started = time.monotonic() - t0
    gateway = stream.gateway
    try:
        for attempt in range(MAX_RECONNECTS + 1):
            if attempt:
                if len(clients) == 1:
                    return stream  # nowhere else to go
                await asyncio.sleep(RECONNECT_PAUSE_S)
                gateway = (gateway + 1) % len(clients)
            try:
                # Once the gateway named the request, a reconnection resumes it; before that, it asks again.
                if await _connect(clients[gateway], stream, api_key, model, t0=t0,
                                  resuming=stream.request_id is not None):
                    return stream
                if stream.dropped_at is not None and stream.drop_after is not None:
                    stream.drop_after = None  # once
                    if stream.back_after_s is None:
                        stream.abandoned = True
                        return stream
                    await asyncio.sleep(stream.back_after_s)
            except (httpx.HTTPError, orjson.JSONDecodeError) as exc:
                stream.error = f"connection: {type(exc).__name__}"
        return stream
    finally:
        stream.ended = time.monotonic() - t0


async def _connect(client: httpx.AsyncClient, stream: Stream, api_key: str, model: str, *, t0: float,
                   resuming: bool) -> bool:
    """One connection: the request, or its resume. True when the stream ended (finished or a final error)."""
    # Its resumes need the events' ids, whatever the gateway's default (gateway.sse_event_ids): without them a
    # stream that broke midway would be taken for one that had no event yet, and replayed whole.
    headers = {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json", "kns-event-ids": "on"}
    method, url, content = "POST", "/chat/completions", body(stream, model)
    if resuming and stream.last_event_id is not None:
        headers["Last-Event-ID"] = stream.last_event_id
    elif resuming and stream.request_id is not None:
        method, url, content = "GET", f"/chat/completions/{stream.request_id}?stream=true", b""
    gap_from = stream.chunk_times[-1] if stream.chunk_times else stream.started
    async with client.stream(method, url, content=content or None, headers=headers) as response:
        stream.status = response.status_code
        if response.status_code != 200:
            error = orjson.loads(await response.aread()).get("error", {})
            stream.error = f"{response.status_code} {error.get('code')}"
            # A resume refused for a moment (the stream registry unavailable, the gateway stopping, the dropped
            # connection not yet released there) is tried again
            return not resuming or response.status_code not in (409, 502, 503)
        stream.request_id = stream.request_id or response.headers.get("x-request-id")
        stream.error = None
        if resuming:
            stream.resumes += 1
        first = True
        async for line in response.aiter_lines():
            had = len(stream.chunk_times)
            _take(stream, line, time.monotonic() - t0)
            if resuming and first and len(stream.chunk_times) > had:
                stream.resume_gaps.append(round(stream.chunk_times[-1] - gap_from, 4))
                first = False
            if (stream.drop_after is not None and stream.dropped_at is None and not stream.done
                    and len(stream.chunk_times) >= stream.drop_after):
                stream.dropped_at = time.time()
                return False  # leaving the block closes the connection mid-stream
    return stream.done


def _take(stream: Stream, line: str, now: float) -> None:
    if line.startswith("id: "):
        stream.last_event_id = line[4:]
        return
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

    def __init__(self, base_urls: list[str], api_key: str, model: str, *, requests: int, concurrency: int,
                 max_tokens: int, label: str, temperature: float = 0.0, seed: int | None = None,
                 mixed: bool = False, conversations: bool = False) -> None:
        self.base_urls, self.api_key, self.model = base_urls, api_key, model
        self.streams = [Stream(i, f"chaos {label} request {i}: tell me a story", max_tokens,
                               gateway=i % len(base_urls)) for i in range(requests)]
        self.concurrency = concurrency
        #: each stream the first turn of a conversation of its own (created before the load starts)
        self.conversations = conversations
        # mixed: every other stream greedy (temperature 0, no seed), the others sampled as asked; every third a
        # structured output (greedy or sampled by the same rule), which a takeover replays from its prompt
        for stream in self.streams:
            if not (mixed and stream.index % 2 == 0):
                stream.temperature, stream.seed = temperature, seed
            if mixed and stream.index % 3 == 2:
                stream.json_schema = STORY
        self.t0 = time.monotonic()
        #: when the scenario's fault began (Unix seconds): the audit counts the streams it hit mid-generation
        self.fault_at: float | None = None

    def now(self) -> float:
        return time.monotonic() - self.t0

    def fault_begins(self) -> None:
        """Called by a scenario at the moment it breaks something (the first time counts)."""
        if self.fault_at is None:
            self.fault_at = time.time()

    async def more(self, n: int) -> None:
        """``n`` more streams, now, all at once (a scenario's second phase); they count with the others."""
        first = self.streams[0]
        extra = [Stream(len(self.streams) + i, f"{first.prompt} (after {i})", first.max_tokens,
                        gateway=i % len(self.base_urls), temperature=first.temperature, seed=first.seed)
                 for i in range(n)]
        self.streams += extra
        async with contextlib.AsyncExitStack() as stack:
            clients = [await stack.enter_async_context(self._client(url, n + 4)) for url in self.base_urls]
            await asyncio.gather(*(run_stream(clients, s, self.api_key, self.model, t0=self.t0) for s in extra))

    @staticmethod
    def _client(base_url: str, connections: int) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(600.0, connect=10.0),
                                 limits=httpx.Limits(max_connections=connections))

    async def open_conversations(self) -> None:
        """One conversation per stream, before the load (what the conversation writer's audit reads back)."""
        headers = {"Authorization": f"Bearer {self.api_key}"}
        async with self._client(self.base_urls[0], 8) as client:
            for stream in self.streams:
                created = await client.post("/conversations", json={}, headers=headers)
                created.raise_for_status()
                stream.conversation_id = created.json()["id"]

    async def run(self, progress: Any = None) -> list[Stream]:
        limit = asyncio.Semaphore(self.concurrency)
        async with contextlib.AsyncExitStack() as stack:
            clients = [await stack.enter_async_context(self._client(url, self.concurrency + 4))
                       for url in self.base_urls]

            async def one(stream: Stream) -> None:
                async with limit:
                    await run_stream(clients, stream, self.api_key, self.model, t0=self.t0)
                    if progress is not None:
                        progress()

            await asyncio.gather(*(one(s) for s in list(self.streams)))
        return self.streams
