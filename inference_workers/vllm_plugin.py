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
``kns bench compare`` gives vLLM's own server the same value), readers spin that many seconds instead.

When :data:`ENGINE_CORE_NAP_ENV` is set (``engine.engine_core_nap_s``), the engine core naps that long between two
looks at its queue while it spins, instead of ``sched_yield``. Its spin starts with each step, which on the CPU
lasts tens of milliseconds, and its first milliseconds are when the worker, the broker and the gateway relay the
tokens the engine core has just sent: ``sched_yield`` gives way only to threads of the spinner's own autogroup,
so theirs waited behind it. A nap gives them the core and still looks at the queue every fraction of a
millisecond, so no message waits for the socket's wake-up (which vLLM can lose, DEVELOPERS.md).

Unset, vLLM is untouched: the plugin is found by every vLLM process started from this environment, vLLM's own
server included.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

from runtime.settings import MAX_ENGINE_CORE_NAP_S, MIN_IDLE_SPIN_S

log = logging.getLogger(__name__)

#: seconds a reader of vLLM's message queues spins after a message before it sleeps (unset: vLLM's own 1 s)
IDLE_SPIN_ENV = "KNS_VLLM_IDLE_SPIN_S"
#: seconds the engine core naps between two looks at its queue while it spins (unset: vLLM's ``sched_yield``)
ENGINE_CORE_NAP_ENV = "KNS_VLLM_ENGINE_CORE_NAP_S"

_PATCHED = "_kns_idle_spin"
_ORIGINAL_YIELD = "_kns_sched_yield"


def register() -> None:
    """Called by vLLM in each of its processes (possibly more than once)."""
    # The settings' own bounds: the variables can also be set by hand, and vLLM's processes read only them.
    spin_s = _seconds(IDLE_SPIN_ENV, lambda s: MIN_IDLE_SPIN_S <= s < float("inf"))
    nap_s = _seconds(ENGINE_CORE_NAP_ENV, lambda s: 0 < s <= MAX_ENGINE_CORE_NAP_S)
    if spin_s is None and nap_s is None:
        return
    try:
        from vllm.distributed.device_communicators import shm_broadcast
    except ImportError as exc:  # a vLLM without it: nothing spins the way this plugin knows
        log.warning("this vLLM has no shm_broadcast (%r): its spinning is left as it is", exc)
        return
    if getattr(shm_broadcast, "SPINLOOP_EXT_ENABLED", False):
        log.warning("VLLM_USE_SPINLOOP_EXT is on: vLLM's readers spin in C before they wait, where neither the "
                    "idle spin nor the engine core's nap applies")
    if spin_s is not None:
        cap_idle_spin(shm_broadcast.SpinCondition, spin_s)
    if nap_s is not None:
        nap_in_engine_core(shm_broadcast, nap_s)


def _seconds(variable: str, valid: Callable[[float], bool]) -> float | None:
    value = os.environ.get(variable)
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")  # fails every bound
    if not valid(seconds):
        log.warning("ignoring %s=%r: out of its bounds (runtime/settings.py); vLLM's own behaviour stays", variable,
                    value)
        return None
    return seconds


def in_engine_core() -> bool:
    """This process is vLLM's engine core (vLLM titles its processes ``VLLM::EngineCore``, ``VLLM::Worker``)."""
    try:
        import setproctitle
    except ImportError:  # vLLM then titles nothing either
        return False
    return "EngineCore" in setproctitle.getproctitle()


def nap_in_engine_core(shm_broadcast: ModuleType, nap_s: float) -> None:
    """Make the engine core's spinners (they call the module's ``sched_yield`` between looks) sleep ``nap_s``
    instead; other processes keep ``sched_yield`` (idempotent)."""
    original: Callable[[], None] = getattr(shm_broadcast, _ORIGINAL_YIELD, None) or shm_broadcast.sched_yield
    napping: bool | None = None

    def sched_yield() -> None:
        nonlocal napping
        if napping is None:  # decided at the first spin: vLLM titles the process before it builds any queue
            napping = in_engine_core()
            if napping:
                log.info("the engine core naps %.2f ms between looks while it spins", nap_s * 1000)
        if napping:
            time.sleep(nap_s)
        else:
            original()

    setattr(shm_broadcast, _ORIGINAL_YIELD, original)
    shm_broadcast.sched_yield = sched_yield  # type: ignore[attr-defined]


def cap_idle_spin(spin_condition: type, spin_s: float) -> None:
    """Make every reader ``spin_condition`` builds from now on spin ``spin_s`` seconds (idempotent)."""
    original = getattr(spin_condition, _PATCHED, None) or spin_condition.__init__  # type: ignore[misc]

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if self.is_reader:
            self.busy_loop_s = spin_s

    setattr(spin_condition, _PATCHED, original)
    spin_condition.__init__ = __init__  # type: ignore[misc]
