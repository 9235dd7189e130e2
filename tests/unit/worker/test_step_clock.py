"""The synthetic engine's step clock: one tick wakes every waiting request; a request cancelled mid-wait does not
cancel the step for the others."""

from __future__ import annotations

import asyncio
import itertools
import os
import subprocess
import sys

import pytest

from inference_workers.synthetic import StepClock, engine_phase
from runtime.settings import REPO_ROOT


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


async def test_a_phased_clock_ticks_on_its_own_grid() -> None:
    """Two engines' clocks a quarter interval apart tick a quarter interval apart (a fleet does not step at once)."""
    interval = 0.04
    ticks = []
    for phase in (0.0, 0.25):
        clock = StepClock(interval, phase)
        await clock.next()
        await clock.next()
        ticks.append(clock._last % interval / interval)  # the grid point it was scheduled for
    assert abs((ticks[1] - ticks[0]) % 1.0 - 0.25) < 1e-6, ticks


def test_engine_phases_differ_per_worker_and_stay_put_across_processes() -> None:
    """Stays put: a restarted worker (another process, another string-hash seed) steps on the same phase."""
    phases = {engine_phase(f"relay-worker-ns-{i}") for i in range(8)}
    assert len(phases) == 8 and all(0 <= p < 1 for p in phases)
    other = subprocess.run([sys.executable, "-c", "from inference_workers.synthetic import engine_phase; "
                            "print(repr(engine_phase('w')))"], cwd=REPO_ROOT, capture_output=True, text=True,
                           check=True, env={**os.environ, "PYTHONHASHSEED": "12345"})
    assert float(other.stdout) == engine_phase("w")
