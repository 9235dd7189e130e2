"""Consumer-group rebalances, with only the requests of partitions that actually move interrupted.

aiokafka's group protocol is eager: every rebalance first revokes every partition, then assigns the new set.
With the sticky assignor (``assignor.py``) most partitions come straight back, so revocation only suspends:

1. on revoke: stop admitting from the partitions, commit what already finished, keep generating — unless this
   worker was expelled from the group (it missed a rebalance: a stall past the session timeout). Then every
   partition it held may have a new owner already, whose producer fenced its own: all are dropped at once;
2. on assign: the partitions that moved away: abort their requests (nothing is committed for them; the new
   owner takes them over from what they emitted) and drop their producers; the partitions gained: start their
   transactional producer first (which fences the previous owner and ends its open transaction), then read
   their committed state; every assigned partition is positioned where this worker resumes it (a retained
   partition is not re-read from its committed offset), and admission resumes under the new generation, which
   numbers the attempts of the requests admitted from then on.

NOTE: aiokafka does not heartbeat while ``on_partitions_assigned`` runs: everything in it is bounded.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Awaitable, Callable, Iterable

from aiokafka import ConsumerRebalanceListener, TopicPartition

from inference_workers.intake import Intake
from inference_workers.offsets import CommittedState, OffsetTracker
from inference_workers.protocol import FinalizerT
from inference_workers.transactions import PartitionTransactions
from runtime.metrics import WORKER_REBALANCES
from schemas.errors import FatalError

log = logging.getLogger(__name__)

#: the committed state of partitions (read after their producer fenced the previous owner)
ReadCommitted = Callable[[set[TopicPartition]], Awaitable[dict[TopicPartition, CommittedState]]]
Seek = Callable[[TopicPartition, int], None]
#: the consumer's group generation now; ``EXPELLED`` after the coordinator stopped recognising the member
Generation = Callable[[], int]
EXPELLED = -1
#: rejoin the group claiming none of these partitions any more (``StickyLoadAssignor.disown``, then a rejoin)
RejoinWithout = Callable[[set[TopicPartition]], None]
#: the longest pause between two membership questions the coordinator left unanswered
MEMBERSHIP_RETRY_MAX_S = 8.0


class Membership(enum.Enum):
    """What the group coordinator says of this worker in a generation."""

    MEMBER = "member"
    #: expelled, replaced, or a rebalance under way: the consumer's own heartbeat hears the same and rejoins
    NOT_MEMBER = "not_member"
    #: no answer (a timeout, the coordinator moving or loading): ask again
    UNKNOWN = "unknown"


#: asks the group coordinator whether this worker is still a member of the given generation
StillMember = Callable[[int], Awaitable[Membership]]


async def _always_member(generation: int) -> Membership:
    return Membership.MEMBER


class RequestRebalanceListener(ConsumerRebalanceListener):
    def __init__(self, intake: Intake, finalizer: FinalizerT, offsets: OffsetTracker,
                 transactions: PartitionTransactions, read_committed: ReadCommitted, seek: Seek,
                 generation: Generation, *, on_expelled: Callable[[], None] = lambda: None,
                 rejoin_without: RejoinWithout = lambda partitions: None, still_member: StillMember = _always_member,
                 membership_check_s: float = 1.0, flush_timeout_s: float = 3.0) -> None:
        self._intake = intake
        self._finalizer = finalizer
        self._offsets = offsets
        self._transactions = transactions
        self._read_committed = read_committed
        self._seek = seek
        self._generation = generation
        self._on_expelled = on_expelled
        self._rejoin_without = rejoin_without
        self._still_member = still_member
        self._membership_check_s = membership_check_s
        #: fenced partitions to rejoin without once this worker knows it is still a member (``_rejoin_soon``),
        #: with the generation each was lost in and the assignments seen by then
        self._fenced: dict[TopicPartition, tuple[int, int]] = {}
        self._rejoining: asyncio.Task[None] | None = None
        #: assignments so far: one since a partition was lost means a rebalance settled it
        self._assignments = 0
        self._stopped = False
        self._flush_timeout_s = flush_timeout_s
        intake.on_stale = self.partition_lost

    @property
    def assigned(self) -> set[TopicPartition]:
        return self._transactions.owned()

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        if not revoked:
            return
        async with self._intake.admission:
            self._intake.suspend(revoked)
            if self._generation() == EXPELLED:
                log.warning("expelled from the group: every partition may have moved", extra={
                    "partitions": _numbers(revoked)})
                WORKER_REBALANCES.labels(outcome="expelled").inc(len(revoked))
                self._on_expelled()  # the next join claims no partition: they are not this worker's any more
                await self._release(self._transactions.owned())
                return
        # What finished before the partitions may move is committed now: the next owner then skips it.
        await self._finalizer.flush(self._flush_timeout_s)

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        self._assignments += 1
        async with self._intake.admission:
            owned = self._transactions.owned()
            moved, gained = owned - assigned, assigned - owned
            WORKER_REBALANCES.labels(outcome="kept").inc(len(owned & assigned))
            WORKER_REBALANCES.labels(outcome="moved").inc(len(moved))
            WORKER_REBALANCES.labels(outcome="gained").inc(len(gained))
            log.info("partitions assigned", extra={"kept": _numbers(owned & assigned), "moved": _numbers(moved),
                                                   "gained": _numbers(gained)})
            if moved:
                await self._release(moved)
            try:
                await self._gain(gained)
            except Exception as exc:  # aiokafka would log and carry on with partitions nobody serves
                log.exception("could not take over partitions; stopping the worker", extra={
                    "partitions": _numbers(gained)})
                self._intake.fail(FatalError(f"could not take over partitions {_numbers(gained)}: {exc!r}"))
                return
            for tp in assigned:
                self._seek(tp, self._offsets.resume_at(tp))
            self._intake.activate(assigned, self._generation())

    async def _gain(self, gained: set[TopicPartition]) -> None:
        for tp in sorted(gained):
            await self._transactions.acquire(tp)
        committed = await self._read_committed(gained) if gained else {}
        for tp in gained:
            self._offsets.restore(tp, committed[tp])

    async def _release(self, partitions: set[TopicPartition]) -> None:
        self._intake.suspend(partitions)
        await self._intake.abort_partitions(partitions, "revoked")
        await self._finalizer.flush(self._flush_timeout_s)  # finished meanwhile: commit while it is still ours
        for tp in partitions:
            self._offsets.revoke([tp])
            await self._transactions.release(tp)

    async def partition_lost(self, tp: TopicPartition) -> None:
        """A commit found this worker fenced on ``tp``: another worker owns it now (this one missed the
        rebalance, e.g. a stall longer than the session timeout), or the coordinator aborted a transaction that
        outlived ``transaction.timeout.ms`` and bumped the producer's epoch. Stop its requests; then, when this
        worker is still a member of the same generation, rejoin without it (``_rejoin_soon``)."""
        async with self._intake.admission:
            if tp not in self._transactions.owned():
                return
            log.warning("fenced on a partition: dropping it", extra={"partition": tp.partition})
            WORKER_REBALANCES.labels(outcome="lost").inc()
            self._intake.suspend([tp])
            await self._intake.abort_partitions([tp], "revoked")
            self._offsets.revoke([tp])
            await self._transactions.release(tp)
            self._rejoin_soon(tp, self._generation())

    def _rejoin_soon(self, tp: TopicPartition, generation: int) -> None:
        """After a fencing with no new owner (a timed-out transaction) the group still assigns the partition
        here, and nothing else would rebalance it: served by nobody. So the worker rejoins, claiming the partition
        no more, and the assignment gives it back as gained (a new producer, its committed state read, its requests
        taken over under a newer attempt) or to another member. Only once the coordinator has said this worker is
        still a member of the generation: an expelled worker (a stall past the session timeout) must rejoin as
        expelled, claiming nothing, which its consumer's own heartbeat sees to. After a short wait, so that one
        rejoin serves every partition fenced meanwhile. Nothing is done for a partition when a rebalance came in
        between (it settled the partition), nor for one this worker serves again."""
        if self._stopped:
            return
        self._fenced[tp] = (generation, self._assignments)
        if self._rejoining is None or self._rejoining.done():
            self._rejoining = asyncio.create_task(self._rejoin_while_still_member(), name="rejoin-fenced")

    async def _rejoin_while_still_member(self) -> None:
        delay = self._membership_check_s  # the fencings of one stall come together: one rejoin
        while self._fenced and not self._stopped:
            await asyncio.sleep(delay)
            fenced, self._fenced = self._fenced, {}
            if not self._due(fenced):
                continue
            answer = await self._membership(self._generation())
            due = self._due(fenced)  # again: a rebalance may have settled them while the coordinator answered
            if answer is Membership.UNKNOWN:
                for tp in due:
                    self._fenced.setdefault(tp, fenced[tp])
                delay = min(max(delay, 0.05) * 2, MEMBERSHIP_RETRY_MAX_S)
                continue
            delay = self._membership_check_s
            if answer is Membership.MEMBER and due and not self._stopped:
                log.warning("rejoining the group without fenced partitions", extra={"partitions": _numbers(due)})
                self._rejoin_without(due)

    def _due(self, fenced: dict[TopicPartition, tuple[int, int]]) -> set[TopicPartition]:
        """Of the fenced partitions, those still to give up: lost in this generation (not expelled), with no
        assignment since, and not served again."""
        generation, owned = self._generation(), self._transactions.owned()
        return {tp for tp, (lost_in, assignments) in fenced.items()
                if lost_in == generation != EXPELLED and assignments == self._assignments and tp not in owned}

    async def _membership(self, generation: int) -> Membership:
        try:
            return await self._still_member(generation)
        except Exception:  # asked again later: losing the question would leave the partitions unserved
            log.warning("could not ask the group coordinator about this worker's membership", exc_info=True)
            return Membership.UNKNOWN

    async def membership_checked(self) -> None:
        """Return once the membership check under way, if any, has ended: it rejoined, found nothing left to give
        up, or was stopped. What a caller waits for before it judges that no rejoin follows."""
        if self._rejoining is not None:
            await asyncio.wait([self._rejoining])

    def stop(self) -> None:
        """The worker is stopping: no rebalance for partitions it drops now (it leaves the group anyway)."""
        self._stopped = True
        if self._rejoining is not None:
            self._rejoining.cancel()
        self._fenced.clear()


def _numbers(partitions: Iterable[TopicPartition]) -> list[int]:
    return sorted(tp.partition for tp in partitions)
