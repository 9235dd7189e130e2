"""Which request offsets may be committed.

A worker runs many requests of a partition at once and they finish out of order. The committed offset of a
partition is therefore the oldest offset still generating (or one past the newest taken when none is): a
crash redelivers exactly the unfinished requests, and the finished ones among them are recognised by their
claims (``claims.py``) and not generated twice. Pure bookkeeping, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable

from aiokafka import TopicPartition


class OffsetTracker:
    def __init__(self) -> None:
        self._open: dict[TopicPartition, set[int]] = {}
        self._next: dict[TopicPartition, int] = {}
        self._committed: dict[TopicPartition, int] = {}

    def assign(self, partitions: Iterable[TopicPartition]) -> None:
        for tp in partitions:
            self._open.setdefault(tp, set())

    def revoke(self, partitions: Iterable[TopicPartition]) -> None:
        for tp in partitions:
            self._open.pop(tp, None)
            self._next.pop(tp, None)
            self._committed.pop(tp, None)

    def taken(self, tp: TopicPartition, offset: int) -> None:
        """A record was handed to the worker: it is open until :meth:`done`."""
        self._open.setdefault(tp, set()).add(offset)
        self._next[tp] = max(self._next.get(tp, 0), offset + 1)

    def done(self, tp: TopicPartition, offset: int) -> None:
        if tp in self._open:
            self._open[tp].discard(offset)

    def committable(self) -> dict[TopicPartition, int]:
        """Offsets to commit now: only partitions whose safe point moved since the last commit."""
        result = {}
        for tp, open_offsets in self._open.items():
            if tp not in self._next:
                continue
            target = min(open_offsets) if open_offsets else self._next[tp]
            if target > self._committed.get(tp, -1):
                result[tp] = target
        return result

    def committed(self, offsets: dict[TopicPartition, int]) -> None:
        for tp, offset in offsets.items():
            if tp in self._open:
                self._committed[tp] = max(self._committed.get(tp, -1), offset)

    def open_count(self, tp: TopicPartition) -> int:
        return len(self._open.get(tp, ()))
