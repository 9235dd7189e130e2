"""Commit only up to the oldest unfinished request of each partition, with the rest of the partition's state in
the commit's metadata, so that a new owner skips exactly what finished."""

from __future__ import annotations

from aiokafka import TopicPartition
from aiokafka.structs import OffsetAndMetadata

from inference_workers.offsets import CommittedState, OffsetTracker, Taken, decode_state

P0 = TopicPartition("requests", 0)
P1 = TopicPartition("requests", 1)


def fresh(*partitions: TopicPartition, at: int = 0) -> OffsetTracker:
    t = OffsetTracker()
    for tp in partitions:
        t.restore(tp, CommittedState(at, at, frozenset()))
    return t


def test_out_of_order_finishes_commit_only_below_the_oldest_open_request() -> None:
    t = fresh(P0, at=10)
    for offset in (10, 11, 12):
        t.taken(P0, offset)
    t.done(P0, 12)
    t.done(P0, 11)
    (om,) = t.committable().values()
    assert om.offset == 10  # 10 still generating: a crash must redeliver it
    assert decode_state(om.offset, om.metadata) == CommittedState(10, 13, frozenset({10}))
    t.committed({P0: om})
    assert t.committable() == {}
    t.done(P0, 10)
    assert t.committable() == {P0: OffsetAndMetadata(13, "")}


def test_a_new_owner_skips_what_finished_and_takes_over_what_was_open() -> None:
    old = fresh(P0, at=100)
    for offset in range(100, 106):
        old.taken(P0, offset)
    for offset in (101, 102, 104):
        old.done(P0, offset)
    committed = old.committable()[P0]

    new = OffsetTracker()
    new.restore(P0, decode_state(committed.offset, committed.metadata))
    assert new.resume_at(P0) == 100
    assert [new.classify(P0, o) for o in range(100, 107)] == [
        Taken.NEW, Taken.FINISHED, Taken.FINISHED, Taken.NEW, Taken.FINISHED, Taken.NEW, Taken.NEW]
    assert new.inherited(P0, 103) and not new.inherited(P0, 106)


def test_the_inherited_state_is_committed_again_until_it_is_re_read() -> None:
    t = OffsetTracker()
    t.restore(P0, CommittedState(100, 110, frozenset({100, 105})))
    assert t.committable() == {}  # nothing moved since the predecessor's commit
    t.taken(P0, 100)
    t.done(P0, 100)  # taken over and finished; 105 not re-read yet and 101-104 finished before
    (om,) = t.committable().values()
    assert decode_state(om.offset, om.metadata) == CommittedState(105, 110, frozenset({105}))


def test_a_partition_not_owned_is_never_tracked_nor_committed() -> None:
    t = fresh(P0)
    t.taken(P0, 5)
    assert not t.taken(P1, 7)  # a record handled after its partition was revoked puts nothing back
    assert t.classify(P1, 7) is Taken.NOT_OURS
    t.revoke([P0])
    t.done(P0, 5)
    assert t.committable() == {}


def test_refetched_records_are_seen_and_handed_back_records_are_fetched_again() -> None:
    t = fresh(P0, at=5)
    t.taken(P0, 5)
    t.taken(P0, 6, open_=False)  # skipped (a duplicate)
    assert t.classify(P0, 5) is Taken.SEEN and t.classify(P0, 6) is Taken.SEEN
    t.taken(P0, 7)
    t.untake(P0, 7)
    assert t.classify(P0, 7) is Taken.NEW and t.resume_at(P0) == 7


def test_unreadable_metadata_says_nothing_beyond_the_offset() -> None:
    assert decode_state(42, "") == CommittedState(42, 42, frozenset())
    assert decode_state(42, "something else") == CommittedState(42, 42, frozenset())
    assert decode_state(42, "kns1;x;1") == CommittedState(42, 42, frozenset())
