"""The priority gate's choice of work queues (pure logic, a fake consumer; the order under a saturated engine runs
on the real stack in tests/e2e/test_priority.py)."""

from __future__ import annotations

import asyncio

from aiokafka import TopicPartition

from inference_workers.priority import STALL_S, WINDOW, PriorityGate
from tests.fakes.priority import Clock, Consumer
from tests.helpers import run_in_virtual_time

HIGH, STD, LOW = (TopicPartition(t, 0) for t in ("q.high", "q.std", "q.low"))
CLASSES = {"q.high": "high", "q.std": "standard", "q.low": "low"}
RANKS = {"high": 0, "standard": 1, "low": 2}


def gate(consumer: Consumer, clock: Clock | None = None, min_share: float = 0.1) -> PriorityGate:
    return PriorityGate(consumer, CLASSES, RANKS, min_share=min_share, refresh_s=0.02, clock=clock or Clock(),
                        position=consumer.positions.get)  # type: ignore[arg-type]


async def test_the_highest_class_waiting_is_fetched_alone_once_the_lower_ones_had_their_share() -> None:
    consumer = Consumer({HIGH: 5, STD: 9, LOW: 9}, {HIGH: 3, STD: 0, LOW: 0})
    g = gate(consumer)
    for _ in range(WINDOW):  # a free flood had the engine: the low class had far more than its share
        g.admitted(LOW)
    g.admitted(STD)
    g.admitted(STD)
    assert await g.select() == [HIGH]


async def test_a_waiting_lower_class_below_its_share_is_fetched_too_after_the_higher() -> None:
    consumer = Consumer({HIGH: 50, STD: 0, LOW: 9}, {HIGH: 0, STD: 0, LOW: 0})
    g = gate(consumer)
    for _ in range(WINDOW):
        g.admitted(HIGH)
    assert await g.select() == [HIGH, LOW]  # 0 of the last 20 admissions were low: its guard lets it in
    g.admitted(LOW)
    assert await g.select() == [HIGH, LOW]  # 1 of 20 < 10 %
    g.admitted(LOW)
    assert await g.select() == [HIGH]  # 2 of 20: its share is met while high requests wait


async def test_with_nothing_waiting_every_partition_is_fetched_in_class_order() -> None:
    consumer = Consumer({HIGH: 3, STD: 4, LOW: 5}, {HIGH: 3, STD: 4, LOW: 5})
    assert await gate(consumer).select() == [HIGH, STD, LOW]


async def test_a_paused_partitions_end_is_looked_up_so_a_request_that_arrived_meanwhile_is_seen() -> None:
    # the engine was full: everything paused, the high queue's watermark is stale; a high request arrived
    consumer = Consumer({HIGH: 1, STD: 0, LOW: 30}, {HIGH: 0, STD: 0, LOW: 10})
    consumer.paused_now = {HIGH, STD, LOW}
    clock = Clock()
    g = gate(consumer, clock)
    for _ in range(WINDOW):
        g.admitted(LOW)
    assert await g.select() == [HIGH]
    assert consumer.lookups == 1
    await g.select()
    assert consumer.lookups == 1  # within refresh_s the last lookup stands
    clock.now += 0.05
    await g.select()
    assert consumer.lookups == 2


async def test_a_partition_without_a_position_is_fetched() -> None:
    consumer = Consumer({HIGH: 0, LOW: 9}, {LOW: 0})  # high just assigned: no position yet
    g = gate(consumer)
    for _ in range(WINDOW):
        g.admitted(LOW)
    assert await g.select() == [HIGH]


async def test_a_worker_that_admits_nothing_while_requests_wait_stops_choosing() -> None:
    """A high partition that reads as waiting but returns nothing (a record no fetch can return): after STALL_S
    without an admission every waiting class is fetched, so the worker never idles behind it."""
    consumer = Consumer({HIGH: 1, LOW: 9}, {HIGH: 0, LOW: 0})
    clock = Clock()
    g = gate(consumer, clock)
    for _ in range(WINDOW):
        g.admitted(LOW)
    assert await g.select() == [HIGH]
    clock.now += STALL_S + 0.1
    assert await g.select() == [HIGH, LOW]
    g.admitted(HIGH)
    assert await g.select() == [HIGH]


def test_the_depth_report_stays_quiet_while_the_loop_selects_and_looks_every_period_once_the_engine_is_full(
        ) -> None:
    """select() looks at every queue on each poll; report_depth() looking as well only doubled the idle worker's
    cost (6 % of its CPU at c=1 by py-spy). A second review: told apart by the clock alone (a period after
    select()'s look), the report raced the loop's next poll, which comes a period later too, and looked anyway on
    the stock loop. The gate's clock is frozen between steps, and the report's periods run on a virtual clock:
    "ten periods passed" means ten report wake-ups ran, however fast the box runs."""
    async def scenario() -> None:
        consumer = Consumer({HIGH: 0, LOW: 0}, {HIGH: 0, LOW: 0})
        clock = Clock()
        g = PriorityGate(consumer, CLASSES, RANKS, min_share=0.1, refresh_s=0.0, clock=clock,
                         position=consumer.positions.get)
        looks = 0
        look = g.waiting

        async def counted(assigned: set[TopicPartition]) -> dict[TopicPartition, int]:
            nonlocal looks
            looks += 1
            return await look(assigned)

        g.waiting = counted  # type: ignore[method-assign]
        full = False
        reporting = asyncio.create_task(g.report_depth(every_s=0.01, engine_full=lambda: full))
        try:
            await g.select()  # the consume loop polls at t = 0
            await asyncio.sleep(0.105)  # ten report periods, none of the gate's clock
            assert looks == 1
            clock.now = 0.0105  # a period and a bit since select(): its next poll is due, not late
            await asyncio.sleep(0.05)  # five more periods
            assert looks == 1
            full = True  # the engine is full: the loop waits for room, no select()
            await asyncio.sleep(0.01)  # one period
            assert looks == 2, "no look with the engine full"
            full = False
            clock.now = 1.0  # room, but no select() for long (a slow batch, a back-off): the report stands in
            await asyncio.sleep(0.01)
            assert looks == 3, "no look while the loop did not select"
        finally:
            reporting.cancel()

    run_in_virtual_time(scenario)
