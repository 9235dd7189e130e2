"""Commit only up to the oldest unfinished request of each partition."""

from __future__ import annotations

from aiokafka import TopicPartition

from inference_workers.offsets import OffsetTracker

P0 = TopicPartition("requests", 0)
P1 = TopicPartition("requests", 1)


def test_out_of_order_finishes_commit_only_below_the_oldest_open_request() -> None:
    t = OffsetTracker()
    t.assign([P0])
    for offset in (10, 11, 12):
        t.taken(P0, offset)
    t.done(P0, 12)
    t.done(P0, 11)
    assert t.committable() == {P0: 10}  # 10 still generating: a crash must redeliver it
    t.committed({P0: 10})
    assert t.committable() == {}
    t.done(P0, 10)
    assert t.committable() == {P0: 13}


def test_partitions_are_independent_and_revoke_forgets() -> None:
    t = OffsetTracker()
    t.assign([P0, P1])
    t.taken(P0, 5)
    t.taken(P1, 7)
    t.done(P1, 7)
    assert t.committable() == {P0: 5, P1: 8}
    t.revoke([P1])
    t.done(P1, 7)
    assert t.committable() == {P0: 5}


def test_nothing_to_commit_before_anything_was_taken() -> None:
    t = OffsetTracker()
    t.assign([P0])
    assert t.committable() == {}
