"""A fake of what the priority gate reads of an aiokafka consumer (assignment, pauses, high watermarks, last stable
offsets, end-offset lookups), asserting on a partition no longer assigned as aiokafka does; and a settable clock."""

from __future__ import annotations

import asyncio

from aiokafka import TopicPartition


class Consumer:
    def __init__(self, ends: dict[TopicPartition, int], positions: dict[TopicPartition, int]) -> None:
        self.ends, self.positions = ends, positions
        self.assigned = set(ends)
        self.paused_now: set[TopicPartition] = set()
        self.lookup_delay_s = 0.0
        self.lookups = 0

    def assignment(self) -> set[TopicPartition]:
        return set(self.assigned)

    def paused(self) -> set[TopicPartition]:
        return self.paused_now & self.assigned

    def highwater(self, tp: TopicPartition) -> int | None:
        assert tp in self.assigned, "Partition is not assigned"  # as aiokafka's
        return self.ends[tp]

    def last_stable_offset(self, tp: TopicPartition) -> int | None:
        assert tp in self.assigned, "Partition is not assigned"
        return self.ends[tp]

    async def end_offsets(self, tps: list[TopicPartition]) -> dict[TopicPartition, int]:
        self.lookups += 1
        await asyncio.sleep(self.lookup_delay_s)
        return {tp: self.ends[tp] for tp in tps}


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now
