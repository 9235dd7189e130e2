"""The worker's event loop (``runtime/event_loop.py``)."""

from __future__ import annotations

import asyncio

import pytest

from runtime import event_loop


async def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__.split(".")[0]


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_the_worker_runs_on_the_loop_it_is_told(loop: event_loop.EventLoop) -> None:
    assert event_loop.run(_loop_module(), loop) == loop
