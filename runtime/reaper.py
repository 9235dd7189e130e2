"""The process tree under /proc, and the reaper: what a dead process started dies with it.

vLLM's ``AsyncLLM`` spawns an engine-core process (which starts a ``VLLM::Worker`` of its own on the CPU build).
The engine core does not watch the process that spawned it: a SIGKILLed worker leaves it running, holding its
memory (the HBM on a GPU) and blocking the worker that replaces it. ``PR_SET_PDEATHSIG`` cannot be set on a process
somebody else spawns, so the worker starts a reaper first (:func:`start_reaper`): a small child process that
records the worker's descendants every ``interval_s`` and, once the worker is gone (however it died), stops them:
SIGTERM to the worker's direct children (vLLM's engine core then shuts its own children down and its
``multiprocessing`` resource tracker unlinks the shared memory), SIGKILL to whatever is left after ``grace_s``.

A process is named by its pid *and* its kernel start time (:class:`Proc`): a pid recycled since it was recorded is
never signalled, and signals go through a pidfd opened before the start time is checked.

Owns: reading /proc, identity-safe signalling, the reaper process. Must not: signal anything it has not seen as a
descendant of the watched process (or, when that process led its own process group, as a member of that group).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Proc:
    """One process as /proc/<pid>/stat showed it. ``pid`` + ``start`` (clock ticks since boot) identify it."""

    pid: int
    ppid: int
    pgid: int
    start: int
    zombie: bool


def read_proc(pid: int) -> Proc | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The comm field (2nd) is in parentheses and may hold spaces or parentheses itself: split after the last ")".
    fields = stat.rsplit(")", 1)[1].split()
    return Proc(pid, int(fields[1]), int(fields[2]), int(fields[19]), fields[0] == "Z")


def process_table() -> dict[int, Proc]:
    table = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (proc := read_proc(int(name))) is not None:
            table[proc.pid] = proc
    return table


def descendants(root: int, table: dict[int, Proc] | None = None) -> list[Proc]:
    """Every live process below ``root`` (children, their children, ...), not ``root`` itself."""
    table = process_table() if table is None else table
    children: dict[int, list[Proc]] = {}
    for proc in table.values():
        children.setdefault(proc.ppid, []).append(proc)
    found: list[Proc] = []
    frontier = [root]
    while frontier:
        for child in children.get(frontier.pop(), []):
            if not child.zombie:
                found.append(child)
                frontier.append(child.pid)
    return found


def is_alive(proc: Proc) -> bool:
    """The very process ``proc`` names is still running (a zombie has finished; a recycled pid is another)."""
    now = read_proc(proc.pid)
    return now is not None and now.start == proc.start and not now.zombie


def send(proc: Proc, sig: int) -> bool:
    """Signal ``proc`` if it is still the process it was. True if the signal was sent."""
    try:
        fd = os.pidfd_open(proc.pid)
    except ProcessLookupError:
        return False
    except OSError:  # no pidfd (old kernel): a check and a kill, with a microsecond-wide window between them
        if not is_alive(proc):
            return False
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, sig)
            return True
        return False
    try:
        # NOTE: from here on the pid cannot be recycled under us: the pidfd pins whatever process it names.
        if not is_alive(proc):
            return False
        signal.pidfd_send_signal(fd, sig)
        return True
    except ProcessLookupError:
        return False
    finally:
        os.close(fd)


def ignores_sigterm(proc: Proc) -> bool:
    try:
        status = Path(f"/proc/{proc.pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return False
    mask = next((line.split()[1] for line in status.splitlines() if line.startswith("SigIgn:")), "0")
    return bool(int(mask, 16) >> (signal.SIGTERM - 1) & 1)


def terminate(procs: Iterable[Proc], *, roots: Iterable[Proc], grace_s: float,
              tick: Callable[[], object] = lambda: None) -> list[Proc]:
    """SIGTERM ``roots``, give every process of ``procs`` up to ``grace_s`` to exit, SIGKILL the rest.

    Only the roots get SIGTERM: they stop their own children (vLLM's engine core stops its ``VLLM::Worker``).
    A process that ignores SIGTERM on purpose exits by itself once the processes it serves are gone
    (``multiprocessing``'s resource tracker, which then unlinks the shared memory they leaked; our reaper): it is
    killed last, after a further moment. ``tick`` runs while waiting (a parent reaps its zombies there).
    Returns the processes that had to be killed.
    """
    procs = list(procs)
    for proc in roots:
        send(proc, signal.SIGTERM)
    killed: list[Proc] = []
    for wait_s, last in ((grace_s, False), (2.0, True)):
        deadline = time.monotonic() + wait_s
        while (alive := [p for p in procs if is_alive(p)]) and time.monotonic() < deadline:
            tick()
            time.sleep(0.05)
        doomed = alive if last else [p for p in alive if not ignores_sigterm(p)]
        for proc in doomed:
            send(proc, signal.SIGKILL)
        killed += doomed
    # SIGKILL takes effect asynchronously (a process tearing down a GPU context takes a moment): wait for it.
    deadline = time.monotonic() + 10
    while any(is_alive(p) for p in killed) and time.monotonic() < deadline:
        tick()
        time.sleep(0.05)
    return killed


# --- the reaper process -------------------------------------------------------------------------------------


def start_reaper(service: str, *, interval_s: float = 1.0, grace_s: float = 10.0) -> subprocess.Popen[bytes]:
    """Start a reaper for this process. Call it before starting anything that must die with this process.

    It stays in this process's process group, so a group-wide SIGKILL takes it too (with everything it watches).
    """
    return subprocess.Popen(
        [sys.executable, "-m", "runtime.reaper", str(os.getpid()), "--service", service,
         "--interval", str(interval_s), "--grace", str(grace_s)],
        stdin=subprocess.DEVNULL,
    )


def _gone_within(watched: int, pidfd: int | None, timeout_s: float) -> bool:
    """Wait up to ``timeout_s``; True as soon as ``watched`` (our parent) has exited."""
    if pidfd is not None:
        readable, _, _ = select.select([pidfd], [], [], timeout_s)
        return bool(readable)
    deadline = time.monotonic() + timeout_s
    while os.getppid() == watched:  # an orphan is adopted by a subreaper or init: its parent pid changes
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


def reap_after(watched: int, *, interval_s: float, grace_s: float) -> list[Proc]:
    """Record ``watched``'s descendants until it exits, then stop them. Returns the processes it stopped."""
    me = os.getpid()
    try:
        pidfd: int | None = os.pidfd_open(watched)
    except OSError:  # gone already (checked below) or no pidfd on this kernel: poll the parent pid instead
        pidfd = None
    recorded: dict[int, Proc] = {}
    # A parent pid other than ``watched`` (already at start) means it is gone: skip straight to the clean-up.
    gone = os.getppid() != watched
    while not gone:
        # 1. Record what runs below the watched process now; forget what has exited since.
        table = process_table()
        recorded = {p.pid: p for p in recorded.values() if p.pid in table and table[p.pid].start == p.start}
        recorded.update((p.pid, p) for p in descendants(watched, table) if p.pid != me)
        # 2. Sleep until the next scan, waking up at once when the watched process exits.
        gone = _gone_within(watched, pidfd, interval_s)
    if pidfd is not None:
        os.close(pidfd)
    # 3. The subtrees of what we recorded are intact (only the dead process's own children were re-parented):
    #    add them, so that a grandchild started after the last scan is found too.
    table = process_table()
    alive = [p for p in recorded.values() if p.pid in table and table[p.pid].start == p.start]
    for proc in alive:
        recorded.update((p.pid, p) for p in descendants(proc.pid, table) if p.pid != me)
    # 4. A watched process that led its own process group (as a supervised service does) leaves its group behind:
    #    its members are its descendants, also those started after the last scan (or, for a shell job, the rest of
    #    its pipeline). A pgid stays allocated while the group has members: this cannot name a stranger's group.
    if os.getpgrp() == watched:
        recorded.update((p.pid, p) for p in table.values() if p.pgid == watched and p.pid != me and not p.zombie)
    targets = [p for p in recorded.values() if is_alive(p)]
    if not targets:
        return []
    # The tops of the recorded subtrees: the watched process's own children (as recorded, before their
    # re-parenting) and orphans whose parent we never saw.
    roots = [p for p in targets if p.ppid == watched or p.ppid not in recorded]
    terminate(targets, roots=roots, grace_s=grace_s)
    return targets


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m runtime.reaper")
    parser.add_argument("watched", type=int)
    parser.add_argument("--service", default="reaper")
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--grace", type=float, default=10.0)
    args = parser.parse_args(argv)
    # The reaper must outlive the process it watches: a Ctrl-C or a SIGTERM meant for that one is not for us.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    stopped = reap_after(args.watched, interval_s=args.interval, grace_s=args.grace)
    if stopped:
        # Imported only now: the reaper stays light while it waits, and the settings are the watched process's.
        from runtime.logs import configure_logging
        from runtime.settings import load_settings

        configure_logging(load_settings().observability, service=args.service)
        log.warning("the watched process is gone: stopped what it left behind",
                    extra={"watched": args.watched, "stopped": [p.pid for p in stopped]})


if __name__ == "__main__":
    main()
