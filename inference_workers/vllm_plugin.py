"""A vLLM general plugin (entry point ``vllm.general_plugins``, see pyproject.toml): how long vLLM's engine
processes spin while they wait for a message.

vLLM loads general plugins in each of its processes (engine core, model workers), which is the only way to reach
them: they are started by vLLM, not by us. A reader of vLLM's shared-memory message queues (the model worker
waiting for the next step, the engine core waiting for the step's output) busy-loops on ``sched_yield`` for a
second after each message before it sleeps on a socket (``SpinCondition.busy_loop_s``, not a vLLM argument). On a
GPU host that buys the lowest step latency with an otherwise idle core. On a CPU host the spinner is the core the
rest of the platform runs on: measured here, the engine core burns about 20 core-seconds per 1,000 tokens
waiting for the model, as much CPU as the model itself (DEVELOPERS.md, "vLLM on the CPU").

When :data:`IDLE_SPIN_ENV` is set (the worker sets it from ``engine.idle_spin_s`` before it starts the engine,
``kns bench compare`` gives vLLM's own server the same value), readers spin that many seconds instead. Unset,
vLLM is untouched: the plugin is found by every vLLM process started from this environment, vLLM's own server
included.
"""

from __future__ import annotations

import logging
import os
from typing import Any

log = logging.getLogger(__name__)

#: seconds a reader of vLLM's message queues spins after a message before it sleeps (unset: vLLM's own 1 s)
IDLE_SPIN_ENV = "KNS_VLLM_IDLE_SPIN_S"

_PATCHED = "_kns_idle_spin"


def register() -> None:
    """Called by vLLM in each of its processes (possibly more than once)."""
    value = os.environ.get(IDLE_SPIN_ENV)
    if value is None:
        return
    try:
        spin_s = float(value)
    except ValueError:
        log.warning("ignoring %s=%r: not a number of seconds", IDLE_SPIN_ENV, value)
        return
    try:
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    except ImportError as exc:  # a vLLM without it: nothing spins the way this plugin knows
        log.warning("%s set, but this vLLM has no SpinCondition (%r): left as it is", IDLE_SPIN_ENV, exc)
        return
    cap_idle_spin(SpinCondition, spin_s)


def cap_idle_spin(spin_condition: type, spin_s: float) -> None:
    """Make every reader ``spin_condition`` builds from now on spin ``spin_s`` seconds (idempotent)."""
    original = getattr(spin_condition, _PATCHED, None) or spin_condition.__init__  # type: ignore[misc]

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if self.is_reader:
            self.busy_loop_s = spin_s

    setattr(spin_condition, _PATCHED, original)
    spin_condition.__init__ = __init__  # type: ignore[misc]
