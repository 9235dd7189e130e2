"""One token record for many requests: how a worker packs the deltas of one engine step (``TokenEvent`` v3).

A worker's engine step yields a delta for every running request; one record per reply partition carries all of
them (the first at the record's top level, the others in ``more``), instead of one record per request. Each delta
keeps its own request id, attempt, ``seq`` and ``token_offset``, so what the readers' merge counts
(``token_stream.py``: order, duplicates, failover, resume positions) is exactly what it was with one record each.
Finals are never packed: each rides alone in its request's commit transaction (``emitter.py``).

Readers take a record apart with :func:`events` (no models for its deltas: the relay's hot path makes one per
token per stream) or ``TokenEvent.split()``. A single-request record is keyed by its
request id, so a reader looking for one request skips the others without decoding; a record of several is not
keyed, and :func:`may_carry` tells from its bytes whether a request can be in it (Avro writes a string's UTF-8
bytes as they are).

Upgrade path: v3 readers read v1/v2 records (schema resolution: ``more`` defaults to empty). A v2 reader does not
know v3's fingerprint, so readers (gateways, processors, workers' prefix readers) are upgraded first, with
workers writing v2 (``KNS_WORKER__TOKEN_RECORD_VERSION=2``: one request per record, as before); then the setting
goes back to 3.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

from schemas.events import TokenDelta, TokenEvent

#: fields a packed delta takes from its record
SHARED = ("worker_id", "emitted_at_us")
DELTA_FIELDS = tuple(TokenDelta.model_fields)
_NOT_FINAL: dict[str, Any] = {"finish_reason": None, "usage": None, "error": None, "error_code": None, "more": []}


class Delta(NamedTuple):
    """A non-final event as a worker emits it: ``TokenEvent``'s fields without the model. A worker makes one per
    running request per engine step, and validating a model for each was a fifth of its loop under load.
    Its fields are ``DELTA_FIELDS`` then ``SHARED``, in that order (a unit test holds it to ``TokenDelta``)."""

    request_id: str
    attempt: int
    seq: int
    token_offset: int
    token_ids: list[int]
    text: str
    worker_id: str
    emitted_at_us: int

    @property
    def is_final(self) -> bool:
        return False

    @property
    def finish_reason(self) -> None:
        return None

    def event(self) -> TokenEvent:
        """The validated event (what a reader decodes from its record)."""
        return TokenEvent(**self._asdict())


def pack(events: Sequence[TokenEvent | Delta]) -> dict[str, Any]:
    """The fields of one record carrying these non-final events, in order (for ``EventCodec.encode_dict``)."""
    if not events:
        raise ValueError("a token record carries at least one event")
    first, rest = events[0], events[1:]
    if any(e.is_final for e in rest):
        raise ValueError("a final token event is never packed with others")
    record = {**first._asdict(), **_NOT_FINAL} if isinstance(first, Delta) else first.model_dump()
    record["more"] = [{name: getattr(e, name) for name in DELTA_FIELDS} for e in rest]
    return record


def events(record: Mapping[str, Any]) -> Iterator[TokenEvent | Delta]:
    """The per-request events of one decoded record, in the order they were emitted. Deltas come as
    :class:`Delta`, not validated again: Avro decoded them to the schema's types already (a reader's hot path
    makes one per token per stream); a final, once per request, is a validated ``TokenEvent``."""
    worker_id, emitted_at_us = record["worker_id"], record["emitted_at_us"]
    if record["finish_reason"] is None:
        yield _delta(record, worker_id, emitted_at_us)
    else:
        yield TokenEvent.model_validate({**record, "more": []})
    for delta in record.get("more") or ():  # ``TokenDelta``: never final
        yield _delta(delta, worker_id, emitted_at_us)


def _delta(fields: Mapping[str, Any], worker_id: str, emitted_at_us: int) -> Delta:
    return Delta(fields["request_id"], fields["attempt"], fields["seq"], fields["token_offset"], fields["token_ids"],
                 fields["text"], worker_id, emitted_at_us)


def may_carry(value: bytes, request_id: bytes) -> bool:
    """False only when the record cannot hold an event of this request (its id is not among its bytes)."""
    return request_id in value
