"""Times the cyclic garbage collector's pauses (``kns_gc_pause_seconds``).

A full collection walks every tracked object, and the event loop stands still for all of it. A gateway has
430k tracked objects once it has started (FastAPI, pydantic, the tokenizer's modules), a worker millions (vLLM,
torch): each full collection stalled every stream of the process for 0.2 s and more, to find no garbage among
objects that live as long as the process. ``freeze_startup`` moves them out of the collector's sight once a
service is up; the objects of its streams are collected as before.
"""

from __future__ import annotations

import gc
import time
from typing import Any

from prometheus_client import Histogram

from runtime.metrics import GC_PAUSE

_started: list[float] = [0.0]
#: each generation's histogram child, resolved once: ``GC_PAUSE.labels`` takes the histogram's lock, which a
#: scrape holds while it copies the children, and a collection may start on any allocation of that very thread
#: (the callback would then wait forever on its own thread's lock)
_pauses: dict[int, Histogram] = {}


def _on_gc(phase: str, info: dict[str, Any]) -> None:
    # a collection never starts while another runs (CPython skips it), so one start slot is enough
    if phase == "start":
        _started[0] = time.perf_counter()
    else:
        pause = _pauses.get(info.get("generation", -1))
        if pause is not None:
            pause.observe(time.perf_counter() - _started[0])


def watch() -> None:
    """Once per process."""
    for generation in range(len(gc.get_threshold())):
        _pauses.setdefault(generation, GC_PAUSE.labels(str(generation)))
    if _on_gc not in gc.callbacks:
        gc.callbacks.append(_on_gc)


def freeze_startup() -> None:
    """Once a service has loaded everything it keeps for life: collect what startup left, then exempt the rest
    from future collections (``gc.freeze``; reference counting still frees what it can)."""
    gc.collect()
    gc.freeze()
