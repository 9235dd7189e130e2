"""The platform's own processes yield the CPU to an inference engine's.

On a host where the engine shares cores with the rest (a CPU host; a GPU host's engine core, the one thread that
keeps the GPU fed), every step of the engine waits for a core at the moment our processes wake to relay the
previous step's tokens: the worker's loop, the Kafka broker, the gateway. At equal priority the scheduler lets
them finish first, and each step is late by their work (measured here: ITL p50 +0.65 to +1.5 ms against vLLM's
server at c=1, DEVELOPERS.md "vLLM on the CPU"). So our processes run at a higher nice level and the engine's at
0: when both want a core, the engine gets it; when it does not, nothing is slower.

Two levels count, and both are raised, never lowered (a process started at a higher level keeps it):

* each thread's: Linux keeps a nice level per thread, and a new thread or process starts at its creator's. So
  :func:`renice` walks ``/proc/<pid>/task``, and the worker yields only once its engine runs: the engine's
  processes, spawned before, keep 0.
* its session's: with ``kernel.sched_autogroup_enabled`` (and no CPU cgroup of its own) the scheduler first
  shares the CPU between sessions, each at its *autogroup*'s nice level, and a thread's level counts only against
  threads of its own session. A service alone in its session yields its autogroup too (:func:`yield_session`).
  Which session is its own, only the launcher knows: a supervisor or a fleet that leads a session of its own
  (the stack, the bench and the tests start each service in one) names it in :data:`SESSION_ENV` for what it
  starts (:func:`own_session_env`). A service started from a shell finds no such name (the shell's session holds
  the shell's other jobs), and the worker never yields its session: it holds its engine. Under cgroups
  (containers, systemd units) the cgroups' CPU weights decide between services instead.

Best effort: a kernel or sandbox that refuses leaves the levels as they were, and the service serves on.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

log = logging.getLogger(__name__)

#: passes over a process's threads: a thread started during a pass by one not reniced yet is caught by the next
_PASSES = 3
#: the session id a supervisor or fleet gives what it starts when the session is its own (and so theirs)
SESSION_ENV = "KNS_OWN_SESSION"
#: without CAP_SYS_ADMIN the kernel takes one autogroup change per 100 ms, machine-wide (EAGAIN otherwise)
_AUTOGROUP_RETRY_S, _AUTOGROUP_PATIENCE_S = 0.11, 2.0


def own_session_env() -> dict[str, str]:
    """What a launcher adds to the environment of the services it starts: its session, when it leads it."""
    return {SESSION_ENV: str(os.getpid())} if os.getsid(0) == os.getpid() else {}


def renice(pid: int, nice: int) -> int:
    """Raise every thread of process ``pid`` to at least ``nice`` (one above it keeps its own). Returns how many
    threads run at ``nice`` or above (0: the process is gone, or nothing could be changed)."""
    at_least = 0
    for _ in range(_PASSES):
        raised, at_least = 0, 0
        for tid in _threads(pid):
            try:
                if os.getpriority(os.PRIO_PROCESS, tid) < nice:
                    os.setpriority(os.PRIO_PROCESS, tid, nice)
                    raised += 1
                at_least += 1
            except OSError:  # gone meanwhile, refused (EPERM, EACCES, a sandbox's ENOSYS): left as it is
                continue
        if not raised:
            break
    return at_least


def yield_session(pid: int, nice: int) -> bool:
    """Raise the autogroup of ``pid``'s session to at least ``nice``. False where there is none to raise (no
    autogroup scheduling, another owner's process, a refusal)."""
    path = Path(f"/proc/{pid}/autogroup")
    deadline = time.monotonic() + _AUTOGROUP_PATIENCE_S
    while True:
        current = autogroup_nice(pid)
        if current is None:
            return False
        if current >= nice:
            return True
        try:
            path.write_text(str(nice))
            return True
        except BlockingIOError:  # another change took the kernel's 100 ms
            if time.monotonic() >= deadline:
                log.warning("autogroup change refused for %.0f s", _AUTOGROUP_PATIENCE_S, extra={"pid": pid})
                return False
            time.sleep(_AUTOGROUP_RETRY_S)
        except OSError:
            return False


def autogroup_nice(pid: int) -> int | None:
    """The nice level of ``pid``'s autogroup ("/autogroup-42 nice 10"); None without autogroup scheduling."""
    try:
        return int(Path(f"/proc/{pid}/autogroup").read_text().split()[-1])
    except (OSError, ValueError, IndexError):
        return None


def yield_to_engines(nice: int, service: str, *, session: bool) -> None:
    """This process, every thread of it, at ``nice`` or above (0: left as it is); with ``session``, its session's
    autogroup too, when its launcher said the session is its own (:data:`SESSION_ENV`). Never raises."""
    if nice <= 0:
        return
    try:
        threads = renice(os.getpid(), nice)
        ours = os.environ.get(SESSION_ENV) == str(os.getsid(0))
        grouped = session and ours and yield_session(os.getpid(), nice)
    except OSError as exc:
        log.warning("could not yield the CPU to the engine", extra={"service": service, "reason": repr(exc)})
        return
    log.info("yielding the CPU to the engine", extra={"service": service, "nice": nice, "threads": threads,
                                                      "session": grouped})


def thread_nice_levels(pid: int) -> dict[int, int]:
    """The nice level of each thread of ``pid``."""
    levels = {}
    for tid in _threads(pid):
        try:
            levels[tid] = os.getpriority(os.PRIO_PROCESS, tid)
        except OSError:  # gone meanwhile
            continue
    return levels


def _threads(pid: int) -> list[int]:
    try:
        return [int(task.name) for task in Path(f"/proc/{pid}/task").iterdir()]
    except OSError:
        return []
