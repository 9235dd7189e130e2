"""How a request's token events add up to the text its client receives: the one definition of that merge.

Two readers assemble a request's stream from the token topic and must agree to the token: the gateway's relay
(what the client is sent) and a worker taking a request over after a failover (what the client already has,
so that it continues from there). Both feed the request's events, in log order, to a :class:`TokenStream`.

Rules, per event of attempt ``a`` (``seq`` counts the events of one attempt, ``token_offset`` is the index in
the completion of the event's first token):

* an event of an older attempt than the newest seen is stale: ignored (a replaced worker's late output);
* within an attempt, a ``seq`` seen before is a duplicate (ignored) and a skipped ``seq`` means events were
  lost: the stream ends in error rather than silently missing text;
* tokens continue exactly where the accepted ones end. A new attempt normally starts there (it continues from
  the emitted prefix). If it starts earlier, the overlap must repeat the accepted token ids and end at an event
  boundary (it is then dropped); anything else would splice two different samples, and ends the stream in error;
* a final event that ends before the tokens already accepted is inconsistent: error.

Pure logic, no I/O. Token ids are kept (4 bytes each) because a new attempt's overlap is checked against them.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

from schemas.events import ErrorCode, TokenEvent
from schemas.token_batch import Delta


@dataclass(frozen=True)
class Accepted:
    """What one event added to the stream."""

    text: str
    tokens: int


class TokenStream:
    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.attempt = 0
        self._next_seq = 0
        self.token_ids: array[int] = array("i")
        self.final: TokenEvent | None = None
        #: why the stream cannot go on (set once; the stream is over), and its ``ErrorCode``
        self.error: str | None = None
        self.error_code: str | None = None
        self.duplicates = 0

    @property
    def ended(self) -> bool:
        return self.final is not None or self.error is not None

    @property
    def tokens(self) -> int:
        return len(self.token_ids)

    def put(self, event: TokenEvent | Delta) -> Accepted | None:
        """Merge one event (a reader's deltas may come model-free: ``token_batch.events``). None: ignored (stale,
        duplicate, or the stream already ended). Check :attr:`error` after a put: an inconsistent event ends the
        stream."""
        if self.ended or event.attempt < self.attempt:
            self.duplicates += 1
            return None
        if event.attempt > self.attempt:
            self.attempt, self._next_seq = event.attempt, 0
        if event.seq < self._next_seq:
            self.duplicates += 1
            return None
        if event.seq > self._next_seq:
            return self._fail(f"token events {self._next_seq}..{event.seq - 1} of attempt {event.attempt} are "
                              "missing")
        self._next_seq = event.seq + 1
        accepted = self._tokens(event)
        if accepted is None:
            return None
        if isinstance(event, TokenEvent) and event.finish_reason is not None:
            self.final = event
        return accepted

    def _tokens(self, event: TokenEvent | Delta) -> Accepted | None:
        start, ids, have = event.token_offset, event.token_ids, len(self.token_ids)
        if start > have:
            return self._fail(f"tokens {have}..{start - 1} never arrived (attempt {event.attempt})")
        if start < have:
            overlap = min(have - start, len(ids))
            if list(ids[:overlap]) != list(self.token_ids[start:start + overlap]):
                return self._fail(f"attempt {event.attempt} diverged from the tokens already sent at token "
                                  f"{start + _first_difference(ids[:overlap], self.token_ids[start:start + overlap])}")
            if start + len(ids) > have:
                return self._fail(f"attempt {event.attempt} overlaps the tokens already sent mid-event "
                                  f"(tokens {start}..{start + len(ids) - 1}, {have} sent)")
            if event.finish_reason is not None and start + len(ids) < have:
                return self._fail(f"attempt {event.attempt} finished at token {start + len(ids)}, before the "
                                  f"{have} tokens already sent")
            return Accepted("", 0)
        try:
            self.token_ids.extend(ids)
        except (OverflowError, TypeError):
            # Avro's int is 32-bit, but fastavro bounds it neither on write nor on read: a bad writer's id decodes
            # to any int. This stream ends (the array kept what came before the bad id: dropped), not its reader.
            del self.token_ids[have:]
            self.fail(f"token ids of attempt {event.attempt} are not the schema's 32-bit ints",
                      ErrorCode.UNDECODABLE_EVENT)
            return None
        return Accepted(event.text, len(ids))

    def _fail(self, reason: str) -> Accepted | None:
        """End the stream as inconsistent; returns None (nothing accepted), for ``return self._fail(...)``."""
        self.fail(reason, ErrorCode.STREAM_INCONSISTENT)
        return None

    def fail(self, reason: str, code: str) -> None:
        """End the stream (an inconsistency, or the reader's side: the relay stopped, a timeout)."""
        if not self.ended:
            self.error, self.error_code = reason, code


def _first_difference(a: object, b: object) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):  # type: ignore[call-overload]
        if x != y:
            return i
    return 0
