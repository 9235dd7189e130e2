"""One request's stream buffer: a single slot that merges deltas.

The relay's one consumer task must never wait on a client, and no token may be dropped: ``put`` merges the
event into the pending delta (text appended, token count added) and returns at once; the client's task
``get``s everything that arrived since its last read. Memory is bounded by the request's own ``max_tokens``.
The collector also restores order and drops duplicates: token events carry ``(attempt, seq)``, and a
redelivered or replayed event (``seq`` already seen) is ignored.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from schemas.events import TokenEvent, TokenUsage


@dataclass
class Delta:
    """What a client has not seen yet."""

    text: str = ""
    token_count: int = 0
    finish_reason: str | None = None
    usage: TokenUsage | None = None
    error: str | None = None
    #: producer timestamps of the merged events (hop latency), oldest first
    emitted_at_us: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class StreamCollector:
    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._parts: list[str] = []
        self._tokens = 0
        self._stamps: list[int] = []
        self._final: TokenEvent | None = None
        self._ready = asyncio.Event()
        self._attempt = 0
        self._next_seq = 0
        #: tokens handed to the client so far (across attempts)
        self._delivered = 0
        self.duplicates = 0

    @property
    def finished(self) -> bool:
        return self._final is not None

    @property
    def delivered(self) -> int:
        """Tokens accepted so far (handed out or still pending)."""
        return self._delivered

    def put(self, event: TokenEvent) -> bool:
        """Merge one event; False when it was a duplicate or stale and ignored."""
        if self._final is not None or event.attempt < self._attempt:
            self.duplicates += 1
            return False
        if event.attempt > self._attempt:
            # A failover restarted generation: its sequence starts again at 0.
            self._attempt, self._next_seq = event.attempt, 0
        if event.seq < self._next_seq:
            self.duplicates += 1
            return False
        self._next_seq = event.seq + 1
        end = event.token_offset + len(event.token_ids)
        if end > self._delivered:
            # A new attempt may repeat tokens the client already has: only what is new goes out.
            self._parts.append(event.text)
            self._tokens += end - max(event.token_offset, self._delivered)
            self._delivered = end
        self._stamps.append(event.emitted_at_us)
        if event.finish_reason is not None:
            self._final = event
        self._ready.set()
        return True

    def fail(self, reason: str) -> None:
        """End the stream from the gateway's side (the relay stopped)."""
        if self._final is None:
            self._final = TokenEvent(
                request_id=self.request_id, attempt=self._attempt, seq=self._next_seq,
                token_offset=self._delivered, token_ids=[], text="", finish_reason="error",
                error=reason, worker_id="relay", emitted_at_us=0,
            )
            self._ready.set()

    async def get(self) -> Delta:
        """Wait for news, then take all of it."""
        await self._ready.wait()
        self._ready.clear()
        delta = Delta(text="".join(self._parts), token_count=self._tokens, emitted_at_us=self._stamps)
        self._parts, self._tokens, self._stamps = [], 0, []
        if self._final is not None:
            delta.finish_reason = self._final.finish_reason
            delta.usage = self._final.usage
            delta.error = self._final.error
        return delta
