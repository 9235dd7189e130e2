"""Which request offsets may be committed, and what a new owner of a partition must not generate again.

A worker runs many requests of a partition at once and they finish out of order. The committed offset of a
partition is therefore the oldest offset still generating (or one past the newest taken when none is), and
the commit's metadata carries the rest of the partition's state: how far records were taken (``next``) and
which of the taken ones above the committed offset are still open. Both ride in the same Kafka transaction
as the finished requests' final events and usage, so the state a new owner reads is exactly what was
committed: records above the committed offset that are neither open nor beyond ``next`` are finished and are
skipped; open ones are taken over (continued from what they emitted); the rest are new.

Pure bookkeeping, no I/O.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field

from aiokafka import TopicPartition
from aiokafka.structs import OffsetAndMetadata

METADATA_VERSION = "kns1"
#: Kafka's default ``offset.metadata.max.bytes``; a longer state is committed without it (claims still guard)
METADATA_MAX_BYTES = 4096


class Taken(enum.Enum):
    """What a fetched record is to this worker."""

    NEW = "new"  # take it
    SEEN = "seen"  # taken (or skipped) before by this worker: a re-fetch
    FINISHED = "finished"  # finished by a previous owner (its commit says so)
    NOT_OURS = "not_ours"  # the partition is not (or no longer) this worker's


@dataclass
class _Partition:
    #: first offset not taken yet by this worker
    next: int
    #: taken and not finished
    open: set[int] = field(default_factory=set)
    #: what the previous owner's commit said: records in [committed, until) not in ``open`` are finished
    inherited_until: int = 0
    inherited_open: frozenset[int] = frozenset()
    committed: int = -1
    #: (offset, metadata) of the last commit: a state committed once is not committed again
    last_commit: tuple[int, str] | None = None


@dataclass(frozen=True)
class CommittedState:
    """A partition's state as its last commit recorded it."""

    offset: int
    next: int
    open: frozenset[int]


def encode_state(offset: int, next_offset: int, open_offsets: Iterable[int]) -> str:
    deltas = ",".join(str(o - offset) for o in sorted(open_offsets))
    return f"{METADATA_VERSION};{next_offset - offset};{deltas}"


def decode_state(offset: int, metadata: str) -> CommittedState:
    """The committed state; metadata we do not understand (none, another format) says nothing beyond the offset."""
    parts = metadata.split(";")
    if len(parts) != 3 or parts[0] != METADATA_VERSION:
        return CommittedState(offset, offset, frozenset())
    try:
        next_offset = offset + int(parts[1])
        open_offsets = frozenset(offset + int(d) for d in parts[2].split(",") if d)
    except ValueError:
        return CommittedState(offset, offset, frozenset())
    return CommittedState(offset, next_offset, open_offsets)


class OffsetTracker:
    def __init__(self) -> None:
        self._parts: dict[TopicPartition, _Partition] = {}

    # --- ownership ------------------------------------------------------------------------------------

    def restore(self, tp: TopicPartition, committed: CommittedState) -> None:
        """Start tracking a partition this worker now owns, from its committed state."""
        part = _Partition(next=committed.offset, inherited_until=committed.next, inherited_open=committed.open,
                          committed=committed.offset)
        part.last_commit = self._state(part)
        self._parts[tp] = part

    def revoke(self, partitions: Iterable[TopicPartition]) -> None:
        for tp in partitions:
            self._parts.pop(tp, None)

    def owns(self, tp: TopicPartition) -> bool:
        return tp in self._parts

    def resume_at(self, tp: TopicPartition) -> int:
        """Where to fetch from: the first offset not taken yet."""
        return self._parts[tp].next

    # --- records --------------------------------------------------------------------------------------

    def classify(self, tp: TopicPartition, offset: int) -> Taken:
        part = self._parts.get(tp)
        if part is None:
            return Taken.NOT_OURS
        if offset < part.next:
            return Taken.SEEN
        if offset < part.inherited_until and offset not in part.inherited_open:
            return Taken.FINISHED
        return Taken.NEW

    def inherited(self, tp: TopicPartition, offset: int) -> bool:
        """Was this record open when the previous owner last committed (it may have emitted tokens)?"""
        part = self._parts.get(tp)
        return part is not None and offset in part.inherited_open

    def taken(self, tp: TopicPartition, offset: int, *, open_: bool = True) -> bool:
        """A record was handed to the worker: open until :meth:`done` (``open_=False``: skipped, nothing to
        finish). False when the partition is not this worker's (any more): nothing is tracked."""
        part = self._parts.get(tp)
        if part is None:
            return False
        if open_:
            part.open.add(offset)
        part.next = max(part.next, offset + 1)
        return True

    def untake(self, tp: TopicPartition, offset: int) -> None:
        """A record was handed back unhandled (its handling was deferred): it will be fetched again."""
        part = self._parts.get(tp)
        if part is not None and offset in part.open:
            part.open.discard(offset)
            if offset == part.next - 1:
                part.next = offset

    def reopen(self, tp: TopicPartition, offset: int) -> None:
        """A record marked done whose commit failed is open again, if this worker took it under the partition's
        current ownership (taken, not committed yet): one lost and regained since starts from the committed state."""
        part = self._parts.get(tp)
        if part is not None and part.committed <= offset < part.next:
            part.open.add(offset)

    def done(self, tp: TopicPartition, offset: int) -> None:
        part = self._parts.get(tp)
        if part is not None:
            part.open.discard(offset)

    # --- commits --------------------------------------------------------------------------------------

    def committable(self, partitions: Iterable[TopicPartition] | None = None) -> dict[TopicPartition,
                                                                                      OffsetAndMetadata]:
        """Offsets to commit now (with the partition state as metadata): only partitions whose state moved."""
        result = {}
        for tp in self._parts if partitions is None else partitions:
            part = self._parts.get(tp)
            state = self._state(part) if part is not None else None
            if part is not None and state is not None and state != part.last_commit:
                result[tp] = OffsetAndMetadata(*state)
        return result

    def _state(self, part: _Partition) -> tuple[int, str] | None:
        # Open records of the previous owner not re-fetched yet are still open: keep saying so.
        inherited_open = {o for o in part.inherited_open if o >= part.next}
        still_open = part.open | inherited_open
        until = max(part.next, part.inherited_until)
        target = min(still_open) if still_open else until
        if target < part.committed:
            return None
        metadata = encode_state(target, until, still_open) if until > target else ""
        if len(metadata) > METADATA_MAX_BYTES:
            metadata = ""
        return target, metadata

    def committed(self, offsets: dict[TopicPartition, OffsetAndMetadata]) -> None:
        for tp, om in offsets.items():
            part = self._parts.get(tp)
            if part is not None:
                part.committed = max(part.committed, om.offset)
                part.last_commit = (om.offset, om.metadata)

    def open_count(self, tp: TopicPartition) -> int:
        part = self._parts.get(tp)
        return len(part.open) if part else 0

    def open_counts(self) -> dict[TopicPartition, int]:
        """Open requests per partition (the assignor prefers to move partitions with the fewest)."""
        return {tp: len(p.open) for tp, p in self._parts.items()}
