"""Priority classes through Kafka: which work queues a worker fetches from next.

Each priority class has a work-queue topic of its own (``TOPICS.work_queues()``, highest first); a worker is a
member of one group over all of them. Before each fetch the consumer loop asks :meth:`PriorityGate.select` which
of its partitions to fetch: those of the highest class that has requests waiting, plus each lower class with
requests waiting whose share of this worker's recent admissions fell below ``min_share`` (its starvation guard);
the others are paused. Nothing is reordered inside a partition, and nothing fetched is dropped.

"Waiting" is a partition's end offset minus the consumer's position. A fetched partition's end offset comes with
each fetch (its high watermark); a paused one's is looked up (one ListOffsets round trip for all of them, at most
every ``refresh_s``), which is what lets an enterprise request that arrived while the engine was full take the next
free slot. The waiting requests per class are the ``kns_worker_queue_depth`` gauge (the autoscaler's input: sum it
over workers).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from functools import partial

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import IllegalStateError

from runtime.metrics import WORKER_QUEUE_DEPTH

log = logging.getLogger(__name__)

#: recent admissions the starvation guard counts shares over
WINDOW = 20
#: nothing admitted for this long while the gate leaves waiting classes out: it stops choosing (``_stalled``)
STALL_S = 2.0
#: how long select() waits for an end-offset lookup before using the last known ends
LOOKUP_WAIT_S = 0.05
#: how often the paused queues' ends are looked up while the engine is full (select() is not called then): when a
#: slot frees and that moment's lookup is slow (a loaded broker), the known ends are at most this old, so a request
#: of a higher class that arrived earlier still takes the slot (with 1 s, free requests once took it in
#: tests/e2e/test_priority.py)
REFRESH_WHILE_FULL_S = 0.1


class PriorityGate:
    def __init__(self, consumer: AIOKafkaConsumer, classes: Mapping[str, str], ranks: Mapping[str, int], *,
                 min_share: float, refresh_s: float, clock: Callable[[], float] = time.monotonic,
                 position: Callable[[TopicPartition], int | None] | None = None) -> None:
        """``classes``: topic → its class name; ``ranks``: class name → rank (0 highest)."""
        self._consumer = consumer
        self._position = position or partial(_position, consumer)
        self._class_of = dict(classes)
        self._rank = dict(ranks)
        self._min_share = min_share
        self._refresh_s = refresh_s
        self._clock = clock
        self._ends: dict[TopicPartition, int] = {}
        self._looked_up_at = float("-inf")
        self._recent: deque[str] = deque(maxlen=WINDOW)
        #: when select() last began to leave waiting classes out with nothing admitted since (see ``_stalled``)
        self._restricted_since: float | None = None
        self._lookup: asyncio.Future[None] | None = None
        #: when select() last looked (the consume loop is fetching): report_depth() has nothing to add then
        self._selected_at = float("-inf")

    def rank(self, tp: TopicPartition) -> int:
        return self._rank.get(self._class_of.get(tp.topic, ""), len(self._rank))

    def admitted(self, tp: TopicPartition) -> None:
        """A record of ``tp`` was handed to the worker."""
        self._recent.append(self._class_of.get(tp.topic, ""))
        self._restricted_since = None

    def share(self, name: str) -> float:
        return self._recent.count(name) / WINDOW

    async def select(self) -> list[TopicPartition]:
        """The partitions to fetch now, highest class first."""
        self._selected_at = self._clock()
        waiting = await self.waiting(self._consumer.assignment())
        assigned = set(waiting)  # what is still assigned after the lookup (a rebalance may have moved some)
        classes = sorted({self._class_of.get(tp.topic, "") for tp, n in waiting.items() if n > 0},
                         key=lambda c: self._rank.get(c, len(self._rank)))
        if classes:
            chosen = {classes[0]} | {c for c in classes[1:] if self.share(c) < self._min_share}
            if chosen == set(classes):
                self._restricted_since = None
            elif self._stalled():
                chosen = set(classes)
            assigned = {tp for tp in assigned if self._class_of.get(tp.topic, "") in chosen}
        return sorted(assigned, key=lambda tp: (self.rank(tp), tp.topic, tp.partition))

    def _stalled(self) -> bool:
        """Fetching only the chosen classes has admitted nothing for STALL_S (a higher class's partition reads as
        waiting but returns nothing): then every class that waits is fetched, so the worker never idles behind a
        queue it cannot read. Time with the engine full does not count: select() is not called then."""
        now = self._clock()
        if self._restricted_since is None:
            self._restricted_since = now
        return now - self._restricted_since > STALL_S

    async def report_depth(self, every_s: float = REFRESH_WHILE_FULL_S, *,
                           engine_full: Callable[[], bool] = lambda: True) -> None:
        """Keep the known ends and the queue-depth gauge current while the loop is not selecting (the engine is
        full: everything is paused, and that is when the depth matters most). One ListOffsets round trip a time.
        With room in the engine the loop selects on each poll (at least every 100 ms) and select() looks then: a
        look here too only doubled the idle worker's cost. So with room it looks only when select() has not for
        two periods (a slow batch, a back-off, no priority classes); with the engine full, every period. (Told
        apart by the clock alone, a period after select()'s look raced select()'s next one.)"""
        while True:
            await asyncio.sleep(every_s)
            if not engine_full() and self._clock() - self._selected_at < 2 * every_s:
                continue
            try:
                await self.waiting(self._consumer.assignment())
            except Exception as exc:  # a rebalance under way, the broker away: measured next time, never fatal
                log.debug("queue depth not measured", extra={"error": repr(exc)})

    async def waiting(self, assigned: set[TopicPartition]) -> dict[TopicPartition, int]:
        """Requests waiting per partition still assigned (and the queue-depth gauge per class)."""
        consumer = self._consumer
        paused = consumer.paused()  # a set built from the whole assignment on each call: once, not once per partition
        stale = [tp for tp in assigned if tp in paused or self._fetched_end(tp) is None]
        lookup = self._lookup
        if stale and self._clock() - self._looked_up_at >= self._refresh_s and (lookup is None or lookup.done()):
            self._looked_up_at = self._clock()
            lookup = self._lookup = asyncio.ensure_future(self._look_up(stale))
        if lookup is not None and not lookup.done():
            # A quick answer is used now; a slow one (a leader moving: aiokafka retries for its request timeout)
            # does not hold up fetching: the last known ends stand in, and it lands in the cache when it comes.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(lookup), LOOKUP_WAIT_S)
        # NOTE: after the await: a rebalance may have moved partitions meanwhile (aiokafka asserts on those).
        assigned = assigned & consumer.assignment()
        paused = consumer.paused()
        waiting: dict[TopicPartition, int] = {}
        depth = dict.fromkeys(self._rank, 0)
        for tp in assigned:
            end = self._fetched_end(tp) if tp not in paused else None
            end = end if end is not None else self._ends.get(tp)
            position = self._position(tp)
            if end is None or position is None:
                waiting[tp] = 1  # unknown: worth a fetch
                continue
            waiting[tp] = max(0, end - position)
            name = self._class_of.get(tp.topic, "")
            depth[name] = depth.get(name, 0) + waiting[tp]
        for name, n in depth.items():
            WORKER_QUEUE_DEPTH.labels(priority=name).set(n)
        return waiting

    async def _look_up(self, partitions: list[TopicPartition]) -> None:
        try:
            self._ends.update(await self._consumer.end_offsets(partitions))
        except Exception as exc:  # the last known ends stand in; the next fetch brings fresh ones
            log.warning("could not look up the work queues' end offsets", extra={"error": repr(exc)})

    def _fetched_end(self, tp: TopicPartition) -> int | None:
        """The end a read_committed consumer can read to, from the last fetch: the last stable offset (the high
        watermark counts records of open transactions, which no fetch returns yet)."""
        try:
            stable = self._consumer.last_stable_offset(tp)
            return stable if stable is not None and stable >= 0 else self._consumer.highwater(tp)
        except (AssertionError, IllegalStateError):  # no longer assigned
            return None


def _position(consumer: AIOKafkaConsumer, tp: TopicPartition) -> int | None:
    """The consumer's position in ``tp``, None while it has none. aiokafka's ``position()`` would wait for one (an
    offset reset of a paused partition may never come), and it has no non-blocking form: read its state."""
    try:
        state = consumer._subscription.subscription.assignment.state_value(tp)
    except AttributeError:  # no subscription or assignment (a rebalance under way)
        return None
    return state.position if state is not None and state.has_valid_position else None
