"""One request's stream buffer: a single slot that merges deltas.

The relay's one consumer task must never wait on a client, and no token may be dropped: ``put`` merges the
event into the pending delta (text appended, token count added) and returns at once; the client's task
``get``s everything that arrived since its last read. Memory is bounded by the request's own ``max_tokens``.
Which events count, and in which order, is :class:`schemas.token_stream.TokenStream`'s to say: duplicates and
stale attempts are dropped, a lost event or a failover that would splice two samples ends the stream in error.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from schemas import token_batch
from schemas.events import TokenEvent, TokenUsage
from schemas.token_stream import TokenStream

#: a deadline this close counts as reached (the event loop's timers are no finer)
TIMER_RESOLUTION_S = 0.001


@dataclass
class Delta:
    """What a client has not seen yet."""

    text: str = ""
    token_count: int = 0
    finish_reason: str | None = None
    usage: TokenUsage | None = None
    error: str | None = None
    error_code: str | None = None
    #: the stream ended with the worker's own final event (not an error found or raised on the gateway's side)
    from_worker: bool = False
    #: producer timestamps of the merged events (hop latency), oldest first
    emitted_at_us: list[int] = field(default_factory=list)
    #: the stream's position at the end of this delta (``runtime/streams.py``): how many deltas it has accepted
    position: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class StreamCollector:
    def __init__(self, request_id: str, *, skip_through: int = 0) -> None:
        self.request_id = request_id
        self.stream = TokenStream(request_id)
        #: deltas through this position are merged but not handed out: a resumed stream's client has them
        self.skip_through = skip_through
        #: deltas accepted so far (the stream's position)
        self.accepted = 0
        #: where its records start on the partition the relay reads them from (set when registered)
        self.from_offset = 0
        #: the text of the deltas skipped (a resumed Responses stream ends with its whole text)
        self.skipped_parts: list[str] = []
        self._parts: list[str] = []
        self._tokens = 0
        self._stamps: list[int] = []
        self._ready = asyncio.Event()
        #: while a ``get`` waits with a timeout: until when (loop time); its timer, and whether it went off
        self._deadline: float | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._expired = False

    @property
    def finished(self) -> bool:
        return self.stream.ended

    @property
    def delivered(self) -> int:
        """Tokens accepted so far (handed out or still pending)."""
        return self.stream.tokens

    @property
    def duplicates(self) -> int:
        return self.stream.duplicates

    def put(self, event: TokenEvent | token_batch.Delta) -> bool:
        """Merge one token event; False when it was ignored (duplicate, stale, or after the end)."""
        was_ended = self.stream.ended
        accepted = self.stream.put(event)
        if accepted is not None:
            self.accepted += 1
        if accepted is not None and self.accepted > self.skip_through:
            if accepted.text:
                self._parts.append(accepted.text)
            self._tokens += accepted.tokens
            self._stamps.append(event.emitted_at_us)
        elif accepted is not None and accepted.text:
            self.skipped_parts.append(accepted.text)
        if (accepted is not None and self.accepted > self.skip_through) or (self.stream.ended and not was_ended):
            self._ready.set()
        return accepted is not None

    def fail(self, reason: str, code: str) -> None:
        """End the stream from the gateway's side (the relay stopped, an undecodable event, a timeout)."""
        if not self.stream.ended:
            self.stream.fail(reason, code)
            self._ready.set()

    def has_news(self) -> bool:
        return self._ready.is_set()

    async def get(self, timeout_s: float | None = None) -> Delta:
        """Wait for news (at most ``timeout_s``: TimeoutError), then take all of it."""
        if not self._ready.is_set():  # news already waiting costs no wait and no timer (a busy stream's usual case)
            if timeout_s is None:
                await self._ready.wait()
            else:
                await self._wait_until(asyncio.get_running_loop().time() + timeout_s)
        self._ready.clear()
        delta = Delta(text="".join(self._parts), token_count=self._tokens, emitted_at_us=self._stamps,
                      position=self.accepted)
        self._parts, self._tokens, self._stamps = [], 0, []
        final, stream = self.stream.final, self.stream
        if final is not None:
            delta.finish_reason, delta.usage, delta.from_worker = final.finish_reason, final.usage, True
            delta.error, delta.error_code = final.error, final.error_code
        elif stream.error is not None:
            delta.finish_reason, delta.error, delta.error_code = "error", stream.error, stream.error_code
        if delta.finish_reason is not None and self._timer is not None:
            self._timer.cancel()
            self._timer = None
        return delta

    async def _wait_until(self, deadline: float) -> None:
        """Wait for news until ``deadline``, else TimeoutError. One timer per stream, moved lazily: each wait only
        moves the deadline (a timer per wait, armed and cancelled at every token, was a tenth of the gateway's
        event loop with thousands of slow streams); the timer re-arms itself for the deadline it finds when it
        goes off early."""
        self._deadline, self._expired = deadline, False
        if self._timer is None or self._timer.when() > deadline:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = asyncio.get_running_loop().call_at(deadline, self._on_timer)
        try:
            await self._ready.wait()
        except asyncio.CancelledError:
            self._forget_expiry()  # cancelled as the timer went off: its wake-up is no news for the next wait
            raise
        finally:
            # NOTE: a cancelled wait cleans up on its task's next step, maybe after another wait began: that one's
            # deadline stays (clearing it, its timer found nobody waiting and it never timed out)
            if self._deadline is deadline:
                self._deadline = None
        if self._forget_expiry():
            raise TimeoutError

    def _forget_expiry(self) -> bool:
        """Whether the timer, not news, ended the wait (then the wake-up is cleared)."""
        if self._expired and not self._stamps and not self.stream.ended:
            self._ready.clear()
            return True
        return False

    def _on_timer(self) -> None:
        self._timer = None
        if self._deadline is None:  # nobody waits: the next wait arms a timer again
            return
        loop = asyncio.get_running_loop()
        # uvloop rounds a timer to whole milliseconds and may go off up to 0.5 ms early: re-arming for less than a
        # millisecond would go off again at once, every loop iteration until its clock ticks
        if self._deadline - loop.time() > TIMER_RESOLUTION_S:
            self._timer = loop.call_at(self._deadline, self._on_timer)
            return
        self._expired = True
        self._ready.set()
