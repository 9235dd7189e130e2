"""The synthetic engine's step clock: one tick wakes every waiting request; a request cancelled mid-wait does not
cancel the step for the others."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from inference_workers.synthetic import StepClock


async def test_one_tick_wakes_every_waiter_and_a_cancelled_one_takes_nobody_with_it() -> None:
    clock = StepClock(0.02)
    waiters = [asyncio.ensure_future(clock.next()) for _ in range(5)]
    await asyncio.sleep(0)
    waiters[0].cancel()
    done, pending = await asyncio.wait(waiters[1:], timeout=1)
    assert len(done) == 4 and not pending
    with pytest.raises(asyncio.CancelledError):
        await waiters[0]


async def test_ticks_follow_one_another_on_the_grid() -> None:
    clock = StepClock(0.01)
    loop = asyncio.get_running_loop()
    times = []
    for _ in range(5):
        await clock.next()
        times.append(loop.time())
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert all(gap > 0.005 for gap in gaps)  # never the tick that just fired again
