"""Adversarial review of the priority gate (f1179e9): pure logic, a fake consumer that behaves as aiokafka's does
where it matters (``highwater``/``last_stable_offset`` assert on a partition no longer assigned)."""

from __future__ import annotations

import asyncio

from aiokafka import TopicPartition

from inference_workers.priority import WINDOW, PriorityGate
from tests.fakes.priority import Clock, Consumer
from tests.helpers import run_in_virtual_time

HIGH, STD, LOW = (TopicPartition(t, 0) for t in ("q.high", "q.std", "q.low"))
CLASSES = {"q.high": "high", "q.std": "standard", "q.low": "low"}
RANKS = {"high": 0, "standard": 1, "low": 2}


def gate(consumer: Consumer, clock: Clock, min_share: float = 0.1) -> PriorityGate:
    return PriorityGate(consumer, CLASSES, RANKS, min_share=min_share, refresh_s=0.02, clock=clock,
                        position=consumer.positions.get)


async def test_a_lower_class_is_not_paused_forever_behind_a_high_partition_that_admits_nothing() -> None:
    """The starvation guard counts admissions, not time: while a high partition reads as waiting but yields no
    admission (refused by ``accepts`` while a stale/lost partition is still assigned, records of an open or
    hanging transaction under read_committed, ...) nothing is ever admitted, so the low class's share never
    drops and low stays paused: the worker idles with room and low requests waiting (until their deadline)."""
    consumer = Consumer({HIGH: 5, LOW: 50}, {HIGH: 0, LOW: 10})
    clock = Clock()
    g = gate(consumer, clock)
    for _ in range(WINDOW):
        g.admitted(LOW)  # the low class had the engine until the high record arrived
    seen_low = False
    for _ in range(600):  # a minute of loop iterations (every 100 ms), no admission at all
        clock.now += 0.1
        seen_low = seen_low or LOW in await g.select()
    assert seen_low, "low never fetched in a minute although nothing at all was admitted"


async def test_a_long_saturation_does_not_switch_the_gate_off() -> None:
    """Guards a fix of the test above (a stall clock since the last admission, as in the uncommitted working
    tree): time with the engine full (no room: select() is not even called) is no stall. 16 slots of 30 s
    requests free one slot every ~2 s: the high class waiting must still be fetched alone."""
    consumer = Consumer({HIGH: 5, LOW: 50}, {HIGH: 0, LOW: 10})
    clock = Clock()
    g = gate(consumer, clock)
    for _ in range(WINDOW // 2):
        g.admitted(LOW)
        g.admitted(HIGH)
    clock.now += 5.0  # the engine was full: the consume loop waited on room_freed, no select(), no admission
    assert await g.select() == [HIGH], "the freed slot went to a coin flip between high and low"


async def test_a_rebalance_during_the_lookup_does_not_raise() -> None:
    """The partitions listed before ``await end_offsets()`` are read after it; one moved away meanwhile makes
    aiokafka's ``highwater()`` assert -> select() raises -> consume() raises -> the worker's consumer task dies."""
    consumer = Consumer({HIGH: 5, STD: 3, LOW: 9}, {HIGH: 0, STD: 0, LOW: 0})
    consumer.paused_now = {LOW}
    g = gate(consumer, Clock())
    real = consumer.end_offsets

    async def lookup_then_rebalance(tps: list[TopicPartition]) -> dict[TopicPartition, int]:
        ends = await real(tps)
        consumer.assigned = {STD, LOW}  # HIGH moved to another worker while the lookup was in flight
        return ends

    consumer.end_offsets = lookup_then_rebalance  # type: ignore[method-assign]
    assert await g.select() == [STD, LOW]  # HIGH no longer ours; LOW under its share


async def test_a_slow_end_offset_lookup_does_not_hold_up_fetching() -> None:
    """The lookup is awaited inline, before every fetch while any partition is paused (each loop iteration once
    refresh_s has passed). aiokafka retries a failing ListOffsets (leader moving, broker slow) until
    request_timeout_ms (kafka.request_timeout_ms + 5 s = 35 s): meanwhile nothing is fetched from any partition,
    the ones whose end is known included. Expected: the last known ends stand in while a lookup is slow."""
    consumer = Consumer({HIGH: 5, LOW: 9}, {HIGH: 0, LOW: 0})
    consumer.paused_now = {LOW}
    clock = Clock()
    g = gate(consumer, clock)
    assert await g.select() == [HIGH, LOW]  # the first lookup is quick: ends known
    consumer.lookup_delay_s = 35.0  # the next one hangs until aiokafka's request timeout
    clock.now += 1.0
    selected = await asyncio.wait_for(g.select(), 1.0)
    assert HIGH in selected


def test_a_slow_lookup_when_a_slot_frees_still_sees_a_high_request_that_arrived_while_the_engine_was_full(
        ) -> None:
    """Once in tests/e2e/test_priority.py: free requests queued behind a full engine took the freed slots
    ahead of an enterprise request that had arrived before. While the engine is full only ``report_depth`` looks
    the paused queues' ends up (every REFRESH_WHILE_FULL_S, then); the lookup select() starts when a slot frees took
    longer than LOOKUP_WAIT_S on the loaded broker, so the gate chose from ends a second old, without the high
    request. On a virtual clock (the gate's clock is the loop's): the reports, the lookups and the freed slot come
    in the order of their times, however loaded the machine."""
    async def scenario() -> None:
        consumer = Consumer({HIGH: 0, LOW: 30}, {HIGH: 0, LOW: 10})
        consumer.paused_now = {HIGH, LOW}
        g = PriorityGate(consumer, CLASSES, RANKS, min_share=0.1, refresh_s=0.02, clock=asyncio.get_running_loop().time,
                         position=consumer.positions.get)
        for _ in range(WINDOW):
            g.admitted(LOW)
        assert await g.select() == [LOW]  # the ends are known: only low waits; then the engine is full
        reporting = asyncio.create_task(g.report_depth())
        try:
            consumer.lookup_delay_s = 0.08  # every lookup from now on: longer than select() waits for one
            consumer.ends[HIGH] = 1  # an enterprise request arrives
            await asyncio.sleep(0.4)  # a slot frees 0.4 s later (four report periods)
            lookups = consumer.lookups
            assert await g.select() == [HIGH]
            assert consumer.lookups == lookups + 1, "select() did not look up: the slow lookup was not exercised"
        finally:
            reporting.cancel()

    run_in_virtual_time(scenario)
