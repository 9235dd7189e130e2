"""PID files name exactly our processes; stop reaches the whole process group and the process tree."""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

from ops.stack.process import PidFile, group_members, spawn, stop, tail
from runtime.reaper import is_alive, read_proc


def test_spawn_and_stop_a_process_group(tmp_path: Path) -> None:
    pid_file = PidFile(tmp_path / "svc.pid")
    # A parent that starts a child: stopping the service must stop both.
    script = ("import subprocess, time; subprocess.Popen(['sleep', '60']); print('RE' + 'ADY', flush=True); "
              "time.sleep(60)")
    pid = spawn([sys.executable, "-c", script], log_file=tmp_path / "svc.log", pid_file=pid_file,
                env=dict(os.environ), cwd=tmp_path)
    deadline = time.monotonic() + 10
    while "READY" not in tail(tmp_path / "svc.log") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(group_members(pid)) == 2
    assert pid_file.live_pid() == pid
    assert stop(pid_file, timeout_s=5)
    assert pid_file.live_pid() is None and not pid_file.path.exists()
    assert group_members(pid) == []  # the child too (zombies awaiting their reaper are not alive)


def test_stop_reaches_a_child_outside_the_group(tmp_path: Path) -> None:
    # A supervisor's child runs in a process group of its own; this one does not even stop on SIGTERM.
    pid_file = PidFile(tmp_path / "svc.pid")
    script = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
              "signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); time.sleep(60)'], "
              "start_new_session=True, stdout=subprocess.PIPE); "
              "p.stdout.readline(); print('CHILD', p.pid, flush=True); time.sleep(60)")  # once it ignores SIGTERM
    spawn([sys.executable, "-c", script], log_file=tmp_path / "svc.log", pid_file=pid_file, env=dict(os.environ),
          cwd=tmp_path)
    deadline = time.monotonic() + 10
    while not (found := re.search(r"^CHILD (\d+)$", tail(tmp_path / "svc.log"), re.M)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert found
    child = read_proc(int(found.group(1)))
    assert child is not None and is_alive(child)
    assert stop(pid_file, timeout_s=2)
    assert not is_alive(child)


def test_a_recycled_pid_is_not_ours(tmp_path: Path) -> None:
    pid_file = PidFile(tmp_path / "svc.pid")
    # Our own pid, but with another start time: what a reused pid looks like.
    pid_file.path.write_text(f"{os.getpid()} 1\n")
    assert pid_file.live_pid() is None
    assert not pid_file.path.exists()
    assert stop(pid_file) is False


def test_tail_of_a_missing_log(tmp_path: Path) -> None:
    assert "no log" in tail(tmp_path / "none.log")
