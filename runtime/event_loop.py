"""The event loop a long-running service of ours runs on.

uvloop by default, as the gateway (uvicorn picks it) and vLLM's own API server (``uvloop.run``) do: the worker's
loop wakes for every engine step, every Kafka fetch and produce and every Redis reply, and the stock asyncio loop
spends more of a core on each wake-up (its selector, transports and callbacks are Python) than uvloop's. What
the worker spends beside its engine slows the engine on a host that shares cores (``cpu_priority.py``).
``cpu.event_loop = "asyncio"`` runs the stock loop: a control for measuring, and a way back should a library
misbehave under uvloop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, Literal, TypeVar

T = TypeVar("T")

EventLoop = Literal["uvloop", "asyncio"]


def run(main: Coroutine[Any, Any, T], loop: EventLoop = "uvloop") -> T:
    """``asyncio.run(main)`` on the chosen loop (uvloop is imported only when chosen: the way back needs none)."""
    factory = None  # asyncio's own
    if loop == "uvloop":
        import uvloop

        factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)
