"""The reaper stops what a dead process left behind, however it died, and never a process it did not see."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime.reaper import Proc, descendants, is_alive, process_table, read_proc, send, terminate
from runtime.settings import REPO_ROOT
from tests.helpers import wait_until

# A parent that starts its reaper and waits for its first scan, then a `sleep` in its own process group, a `sleep` in
# a session of its own (out of the parent's group) and a Python process that ignores SIGTERM; prints the reaper's pid
# and theirs.
PARENT = """
import os, signal, subprocess, sys, time
from runtime.reaper import start_reaper
reaper = start_reaper("test-reaper", interval_s={interval}, grace_s=1.0)
while not open(f"/proc/{{reaper.pid}}/wchan").read().startswith("poll_schedule_timeout"):
    time.sleep(0.01)  # the reaper sleeps between its scans: the first one is done
kids = [subprocess.Popen(["sleep", "300"]),
        subprocess.Popen(["sleep", "300"], start_new_session=True),
        subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                          "print('ready', flush=True); time.sleep(300)"], stdout=subprocess.PIPE, text=True)]
kids[2].stdout.readline()  # the python child has installed its handler
print(reaper.pid, " ".join(str(k.pid) for k in kids), flush=True)
time.sleep(300)
"""


def _wait_gone(procs: list[Proc], timeout_s: float) -> list[Proc]:
    deadline = time.monotonic() + timeout_s
    while (alive := [p for p in procs if is_alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


def _sleeps(pid: int) -> int:
    """How often a process has gone to sleep (the kernel's count of its voluntary context switches)."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("voluntary_ctxt_switches")))


def _scanned_since(reaper: int, sleeps: int) -> bool:
    """Whether the reaper has run a whole scan since it had gone to sleep ``sleeps`` times: it sleeps once between
    two scans (in ``select``), so two more sleeps, and asleep now, mean one scan began after that count and ended."""
    asleep = Path(f"/proc/{reaper}/wchan").read_text().startswith("poll_schedule_timeout")
    return asleep and _sleeps(reaper) >= sleeps + 2


@contextlib.contextmanager
def parent(*, interval: float, own_group: bool) -> Iterator[tuple[subprocess.Popen[str], int, list[Proc]]]:
    proc = subprocess.Popen([sys.executable, "-c", PARENT.format(interval=interval)], cwd=REPO_ROOT,
                            stdout=subprocess.PIPE, text=True, process_group=0 if own_group else None)
    kids: list[Proc] = []
    try:
        assert proc.stdout is not None
        reaper, *pids = proc.stdout.readline().split()
        kids = [p for pid in pids if (p := read_proc(int(pid))) is not None]
        assert len(kids) == 3, pids
        yield proc, int(reaper), kids
    finally:
        for target in [*descendants(proc.pid), *kids]:
            send(target, signal.SIGKILL)
        proc.kill()
        proc.wait()


def test_a_sigkilled_process_takes_its_descendants_along() -> None:
    with parent(interval=0.2, own_group=False) as (proc, reaper, kids):
        sleeps = _sleeps(reaper)
        wait_until(lambda: _scanned_since(reaper, sleeps), "a scan of the reaper's since the children started")
        os.kill(proc.pid, signal.SIGKILL)  # the parent alone, as a crash or the OOM killer would
        # SIGTERM to the sleeps; the python one ignores it: SIGKILL after the 1 s grace and 2 s more
        assert _wait_gone(kids, 5) == []


def test_processes_started_after_the_last_scan_go_too_when_the_parent_led_its_group() -> None:
    # One scan at start-up, before the children start; the next in a minute: they are found through the group.
    with parent(interval=60, own_group=True) as (proc, _reaper, kids):
        os.kill(proc.pid, signal.SIGKILL)
        same_group, own_session, ignores_term = kids
        assert _wait_gone([same_group, ignores_term], 5) == []
        # Left: a process that was neither seen below the parent nor stayed in its group is not the reaper's.
        assert is_alive(own_session)


def test_the_reaper_exits_with_its_process_and_leaves_strangers_alone(tmp_path: Path) -> None:
    stranger = subprocess.Popen(["sleep", "300"])
    try:
        script = ("import time; from runtime.reaper import start_reaper; "
                  "r = start_reaper('test-reaper', interval_s=0.2); print(r.pid, flush=True); time.sleep(0.5)")
        out = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True,
                             timeout=30, check=True)
        reaper = read_proc(int(out.stdout.split()[0]))
        assert reaper is None or _wait_gone([reaper], 5) == []
        assert stranger.poll() is None
    finally:
        stranger.kill()
        stranger.wait()


def test_a_recycled_pid_is_never_signalled() -> None:
    sleeper = subprocess.Popen(["sleep", "300"])
    try:
        proc = read_proc(sleeper.pid)
        assert proc is not None and is_alive(proc)
        # The same pid with another start time: what a recorded process whose pid was reused looks like.
        older = Proc(proc.pid, proc.ppid, proc.pgid, proc.start - 1, False)
        assert not is_alive(older)
        assert send(older, signal.SIGKILL) is False
        assert sleeper.poll() is None
        assert send(proc, signal.SIGKILL) is True
        assert sleeper.wait(5) == -signal.SIGKILL
    finally:
        sleeper.kill()
        sleeper.wait()


@pytest.mark.parametrize("zombie", [False, True])
def test_descendants_are_live_children_and_their_children(zombie: bool) -> None:
    script = ("import subprocess, time; a = subprocess.Popen(['sleep', '300']); "
              "b = subprocess.Popen(['sh', '-c', 'sleep 300 & wait']); "
              f"{'a.kill(); ' if zombie else ''}"
              "print(a.pid, b.pid, flush=True); time.sleep(300)")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        a, b = (int(pid) for pid in proc.stdout.readline().split())
        wait_until(lambda: [p for p in process_table().values() if p.ppid == b], "the shell's grandchild")
        if zombie:
            wait_until(lambda: (p := read_proc(a)) is not None and p.zombie, "the killed child a zombie")
        found = {p.pid: p for p in descendants(proc.pid)}
        assert b in found and (a in found) is not zombie  # a zombie has finished: not a live descendant
        assert [p for p in found.values() if p.ppid == b]  # the grandchild
    finally:
        for target in descendants(proc.pid):
            send(target, signal.SIGKILL)
        proc.kill()
        proc.wait()


def test_a_process_that_ignores_sigterm_is_killed_last(tmp_path: Path) -> None:
    # ``busy`` catches SIGTERM and goes on (an engine stuck in a step); ``tracker`` ignores SIGTERM and exits by
    # itself, cleaning up, once ``busy`` is gone (as multiprocessing's resource tracker does at EOF).
    cleaned = tmp_path / "cleaned"
    busy = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, lambda *_: "
                             "None); print('ready', flush=True); time.sleep(300)"], stdout=subprocess.PIPE, text=True)
    tracker = subprocess.Popen([sys.executable, "-c", f"import os, signal, time; signal.signal(signal.SIGTERM, "
                                f"signal.SIG_IGN); print('ready', flush=True)\nwhile os.path.exists('/proc/{busy.pid}')"
                                f" and open('/proc/{busy.pid}/stat').read().split(') ')[1][0] != 'Z': time.sleep(0.05)"
                                f"\nopen({str(cleaned)!r}, 'w').write('clean')"], stdout=subprocess.PIPE, text=True)
    try:
        for child in (busy, tracker):  # both have installed their handlers
            assert child.stdout is not None and child.stdout.readline() == "ready\n"
        procs = [p for p in (read_proc(busy.pid), read_proc(tracker.pid)) if p is not None]
        killed = terminate(procs, roots=procs, grace_s=0.5, tick=lambda: busy.poll())
        assert [p.pid for p in killed] == [busy.pid]
        assert cleaned.read_text() == "clean"
    finally:
        for proc in (busy, tracker):
            proc.kill()
            proc.wait()
