"""The sticky, load-aware assignment: partitions stay where they are as far as balance allows; the ones that
must move are the ones with the fewest requests in flight (defect 2 of the correctness issue: every group change
used to restart every in-flight request on every worker)."""

from __future__ import annotations

from aiokafka import TopicPartition

from inference_workers.assignor import Member, assign, decode_member, encode_member

T = "requests"


def tps(*numbers: int) -> set[TopicPartition]:
    return {TopicPartition(T, n) for n in numbers}


def moved(before: dict[str, set[TopicPartition]], after: dict[str, set[TopicPartition]]) -> int:
    return sum(len(after[m] - before.get(m, set())) for m in after)


def test_a_new_group_is_balanced() -> None:
    result = assign({T: list(range(6))}, {"a": Member({T}), "b": Member({T}), "c": Member({T})})
    assert sorted(len(p) for p in result.values()) == [2, 2, 2]
    assert set().union(*result.values()) == tps(*range(6))


def test_a_joining_member_takes_only_its_share_and_the_idlest_partitions() -> None:
    before = {"a": tps(0, 1, 2), "b": tps(3, 4, 5)}
    load = {TopicPartition(T, n): n_load for n, n_load in enumerate([5, 0, 3, 2, 7, 1])}
    members = {"a": Member({T}, before["a"], {tp: n for tp, n in load.items() if tp in before["a"]}),
               "b": Member({T}, before["b"], {tp: n for tp, n in load.items() if tp in before["b"]}),
               "c": Member({T})}
    after = assign({T: list(range(6))}, members)
    assert moved(before, after) == 2  # the minimum: the newcomer's 2
    assert after["c"] == tps(1, 5)  # the idlest partition of each old member (0 and 1 requests in flight)
    assert after["a"] == tps(0, 2) and after["b"] == tps(3, 4)


def test_a_leaving_member_hands_over_only_its_own_partitions() -> None:
    before = {"a": tps(0, 1), "b": tps(2, 3), "c": tps(4, 5)}
    after = assign({T: list(range(6))}, {"a": Member({T}, before["a"]), "b": Member({T}, before["b"])})
    assert before["a"] <= after["a"] and before["b"] <= after["b"]
    assert after["a"] | after["b"] == tps(*range(6))


def test_a_partition_claimed_twice_goes_to_one_member_only() -> None:
    after = assign({T: list(range(2))}, {"a": Member({T}, tps(0, 1), {TopicPartition(T, 1): 4}),
                                         "b": Member({T}, tps(1))})
    assert after["a"] & after["b"] == set() and after["a"] | after["b"] == tps(0, 1)


def test_member_metadata_round_trips_and_garbage_means_a_new_member() -> None:
    member = decode_member([T], encode_member(tps(1, 2), {TopicPartition(T, 2): 3}))
    assert member.owned == tps(1, 2) and member.load == {TopicPartition(T, 2): 3}
    assert decode_member([T], b"\x00\x01garbage").owned == set()
