"""Which worker owns which request partition: a sticky, load-aware assignment.

Kafka's classic group protocol revokes every partition at every rebalance and lets the group leader assign
them all again. A partition that changes owner costs its in-flight requests a takeover (the new owner continues
each from what it emitted); one that stays costs nothing. So this assignor keeps every partition where it is
as far as a balanced assignment allows, and when some must move it moves the ones with the fewest requests in
flight (each member reports its own in its join metadata). A worker that joins a busy group therefore takes
idle partitions first, and a worker that leaves hands its partitions to the least loaded members.

Balanced: every subscribed member gets ``n // m`` or ``n // m + 1`` of a topic's ``n`` partitions.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from aiokafka.cluster import ClusterMetadata
from aiokafka.coordinator.assignors.abstract import AbstractPartitionAssignor
from aiokafka.coordinator.protocol import ConsumerProtocolMemberAssignment, ConsumerProtocolMemberMetadata
from aiokafka.structs import TopicPartition

log = logging.getLogger(__name__)

Load = Callable[[], Mapping[TopicPartition, int]]


@dataclass
class Member:
    topics: set[str]
    owned: set[TopicPartition] = field(default_factory=set)
    #: requests in flight per owned partition
    load: dict[TopicPartition, int] = field(default_factory=dict)


def assign(partitions: Mapping[str, list[int]], members: Mapping[str, Member]) -> dict[str, set[TopicPartition]]:
    """The assignment (pure). ``partitions``: topic → its partition numbers."""
    result: dict[str, set[TopicPartition]] = {m: set() for m in members}
    for topic, numbers in sorted(partitions.items()):
        subscribed = sorted(m for m, info in members.items() if topic in info.topics)
        if subscribed:
            for member, tps in _assign_topic(topic, sorted(numbers), subscribed, members).items():
                result[member] |= tps
    return result


def _assign_topic(topic: str, numbers: list[int], subscribed: list[str], members: Mapping[str, Member]
                  ) -> dict[str, set[TopicPartition]]:
    load: dict[TopicPartition, int] = {}
    claims: dict[TopicPartition, str] = {}
    for member in subscribed:  # a partition two members claim (one was presumed dead) goes to the busier one
        for tp in members[member].owned:
            if tp.topic != topic or tp.partition not in numbers:
                continue
            busy = members[member].load.get(tp, 0)
            if tp not in claims or busy > load.get(tp, 0):
                claims[tp], load[tp] = member, busy
    kept: dict[str, list[TopicPartition]] = {m: [] for m in subscribed}
    for tp, member in claims.items():
        kept[member].append(tp)
    base, extra = divmod(len(numbers), len(subscribed))
    # Members that already hold more get the larger quotas: fewer partitions move.
    by_holding = sorted(subscribed, key=lambda m: (-len(kept[m]), m))
    quota = {m: base + (1 if i < extra else 0) for i, m in enumerate(by_holding)}
    result: dict[str, set[TopicPartition]] = {}
    released: list[TopicPartition] = []
    for member in subscribed:
        mine = sorted(kept[member], key=lambda tp: (-load.get(tp, 0), tp.partition))  # busiest stay
        result[member] = set(mine[:quota[member]])
        released += mine[quota[member]:]
    unowned = [TopicPartition(topic, n) for n in numbers if TopicPartition(topic, n) not in claims]
    pool = sorted(released + unowned, key=lambda tp: (load.get(tp, 0), tp.partition))
    for member in subscribed:
        while len(result[member]) < quota[member]:
            result[member].add(pool.pop(0))
    return result


def encode_member(owned: Iterable[TopicPartition], load: Mapping[TopicPartition, int], disowned: int = 0) -> bytes:
    return json.dumps({"v": 1, "owned": [[tp.topic, tp.partition] for tp in sorted(owned)],
                       "load": [[tp.topic, tp.partition, n] for tp, n in sorted(load.items()) if n],
                       **({"disowned": disowned} if disowned else {})}).encode()


def decode_member(topics: Iterable[str], user_data: bytes) -> Member:
    member = Member(topics=set(topics))
    try:
        data = json.loads(user_data) if user_data else {}
        member.owned = {TopicPartition(t, p) for t, p in data.get("owned", ())}
        member.load = {TopicPartition(t, p): int(n) for t, p, n in data.get("load", ())}
    except (ValueError, TypeError):  # another assignor's data, or none: this member owns nothing yet
        log.warning("unreadable member metadata in the request group; treating the member as new")
    return member


class StickyLoadAssignor(AbstractPartitionAssignor):
    """aiokafka's assignor interface over :func:`assign`. One instance per consumer: it remembers the member's
    own assignment (and asks ``load`` for its in-flight requests) to tell the group leader at the next join."""

    name = "kns-sticky-load"
    version = 0

    def __init__(self, load: Load) -> None:
        self._load = load
        self._owned: list[TopicPartition] = []
        #: how often this member gave partitions up (``disown``): part of its metadata, which it changes
        self._disowned = 0

    def metadata(self, topics: Iterable[str]) -> ConsumerProtocolMemberMetadata:
        load = {tp: n for tp, n in self._load().items() if tp in set(self._owned)}
        return ConsumerProtocolMemberMetadata(self.version, sorted(topics),
                                              encode_member(self._owned, load, self._disowned))

    def assign(self, cluster: ClusterMetadata,
               members: Mapping[str, ConsumerProtocolMemberMetadata]) -> dict[str, ConsumerProtocolMemberAssignment]:
        decoded = {m: decode_member(meta.subscription, meta.user_data) for m, meta in members.items()}
        topics = {t for member in decoded.values() for t in member.topics}
        partitions = {t: sorted(cluster.partitions_for_topic(t) or ()) for t in topics}
        result = assign(partitions, decoded)
        return {m: ConsumerProtocolMemberAssignment(self.version, _by_topic(tps), b"") for m, tps in result.items()}

    def on_assignment(self, assignment: ConsumerProtocolMemberAssignment) -> None:
        self._owned = assignment.partitions()

    def forget(self) -> None:
        """This member was expelled: what it owned is another member's now; it claims nothing at the next join."""
        self._owned = []

    def disown(self, partitions: Iterable[TopicPartition]) -> None:
        """This member dropped ``partitions`` (fenced on them) while still in the group: it claims them no more,
        and its next join's metadata differs from its last. That is what makes the join a rebalance: Kafka's
        coordinator answers a follower that rejoins with unchanged metadata with the current generation, and the
        partitions would come back under the generation that already numbered their requests' attempts."""
        gone = set(partitions)
        self._owned = [tp for tp in self._owned if tp not in gone]
        self._disowned += 1


def _by_topic(tps: Iterable[TopicPartition]) -> list[tuple[str, list[int]]]:
    topics: dict[str, list[int]] = {}
    for tp in sorted(tps):
        topics.setdefault(tp.topic, []).append(tp.partition)
    return sorted(topics.items())
