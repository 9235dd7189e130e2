"""The platform's own processes yield the CPU to an inference engine's.

On a host where the engine shares cores with the rest (a CPU host; a GPU host's engine core, the one thread that
keeps the GPU fed), every step of the engine waits for a core at the moment our processes wake to relay the
previous step's tokens: the worker's loop, the Kafka broker, the gateway. At equal priority the scheduler lets
them finish first, and each step is late by their work (measured here: +1.5 ms on a 52 ms step at c=1,
DEVELOPERS.md "vLLM on the CPU"). So our processes run at a higher nice level and the engine's at 0: when both
want a core, the engine gets it; when it does not, nothing is slower.

Linux keeps a nice level per thread, and a new thread or process starts at its creator's: renicing every thread
of a process covers what it starts later too. That is also why the worker yields only once its engine runs: the
engine's processes, started before, keep 0. Raising one's own nice needs no privilege; lowering it back does.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)


def renice(pid: int, nice: int) -> int:
    """Set every thread of process ``pid`` to ``nice`` (those it can: a thread gone meanwhile, or one above
    ``nice`` without the privilege to lower it, keeps its own). Returns how many threads now run at ``nice``."""
    done = 0
    try:
        tids = [int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()]
    except (FileNotFoundError, ProcessLookupError):
        return 0
    for tid in tids:
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) != nice:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
            done += 1
        except (ProcessLookupError, PermissionError):
            continue
    return done


def yield_to_engines(nice: int, service: str) -> None:
    """This process, every thread of it, at ``nice`` (0: left as it is)."""
    if nice <= 0:
        return
    threads = renice(os.getpid(), nice)
    log.info("yielding the CPU to the engine", extra={"service": service, "nice": nice, "threads": threads})


def thread_nice_levels(pid: int) -> dict[int, int]:
    """The nice level of each thread of ``pid`` (from ``/proc``: field 19 of each thread's stat)."""
    levels = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue
        levels[int(task.name)] = int(stat.rsplit(")", 1)[1].split()[16])
    return levels
