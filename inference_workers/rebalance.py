"""Consumer-group rebalances. On revoke: stop generating the revoked partitions' requests (the new owner
will), commit everything already finished, forget the partitions. On assign: start tracking them."""

from __future__ import annotations

import logging

from aiokafka import ConsumerRebalanceListener, TopicPartition

from inference_workers.emitter import Finalizer
from inference_workers.intake import Intake
from inference_workers.offsets import OffsetTracker

log = logging.getLogger(__name__)


class RequestRebalanceListener(ConsumerRebalanceListener):
    def __init__(self, intake: Intake, finalizer: Finalizer, offsets: OffsetTracker) -> None:
        self._intake = intake
        self._finalizer = finalizer
        self._offsets = offsets
        self.assigned: set[TopicPartition] = set()

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        if not revoked:
            return
        log.info("partitions revoked", extra={"partitions": sorted(tp.partition for tp in revoked)})
        await self._intake.abort_partitions(revoked, "revoked")
        # NOTE: commit what finished before the partitions move, or the new owner would skip nothing.
        await self._finalizer.flush()
        self._offsets.revoke(revoked)
        self.assigned -= set(revoked)

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        log.info("partitions assigned", extra={"partitions": sorted(tp.partition for tp in assigned)})
        self._offsets.assign(assigned)
        self.assigned |= set(assigned)
