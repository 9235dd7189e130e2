"""Start and stop exactly the processes the stack manager owns.

A PID file holds the pid and the process's kernel start time, so a recycled pid is never mistaken for ours
and ``down`` never signals a stranger. Each service runs in its own session (process group). Our own services are
supervisors whose child runs in a process group of its own (``runtime.supervisor``): stopping a service therefore
waits for its whole process tree, not only its group, and SIGKILLs what is left of both after the timeout.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from runtime.reaper import Proc, descendants, is_alive, process_table, read_proc, send


@dataclass(frozen=True)
class PidFile:
    path: Path

    def read(self) -> tuple[int, str] | None:
        try:
            pid_text, start = self.path.read_text().split()
            return int(pid_text), start
        except (FileNotFoundError, ValueError):
            return None

    def write(self, pid: int) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(f"{pid} {_start_time(pid)}\n")

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)

    def live_pid(self) -> int | None:
        """The pid if that very process is still alive, else None (and a stale file is removed)."""
        entry = self.read()
        if entry is None:
            return None
        pid, start = entry
        if _start_time(pid) != start:
            self.clear()
            return None
        return pid


def _start_time(pid: int) -> str:
    # Field 22 of /proc/<pid>/stat: start time in clock ticks since boot; the comm field may hold spaces.
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return "gone"
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] == "Z":  # a zombie is as good as gone
        return "gone"
    return fields[19]


def spawn(cmd: list[str], *, log_file: Path, pid_file: PidFile, env: dict[str, str], cwd: Path) -> int:
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with log_file.open("ab") as out:
        out.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} starting: {' '.join(cmd)}\n".encode())
        out.flush()
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=cwd,
            env=env,
            start_new_session=True,
        )
    pid_file.write(proc.pid)
    return proc.pid


def stop(pid_file: PidFile, *, timeout_s: float = 30.0) -> bool:
    """SIGTERM the service's process group, SIGKILL what is left of its group and process tree after ``timeout_s``.
    True if something was stopped. Returns once nothing of the service is left (or 10 s after the SIGKILL)."""
    pid = pid_file.live_pid()
    root = read_proc(pid) if pid is not None else None
    if pid is None or root is None:
        pid_file.clear()
        return False
    tracked = _service_tree(root, {})
    _signal_group(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        _reap(pid)
        tracked = _service_tree(root, tracked)
        if not any(is_alive(p) for p in tracked.values()):
            break
        time.sleep(0.1)
    else:
        if is_alive(root):
            _signal_group(pid, signal.SIGKILL)
        for proc in tracked.values():
            send(proc, signal.SIGKILL)
        while any(is_alive(p) for p in tracked.values()) and time.monotonic() < deadline + 10:
            _reap(pid)
            time.sleep(0.1)
    _reap(pid)
    pid_file.clear()
    return True


def _service_tree(root: Proc, tracked: dict[int, Proc]) -> dict[int, Proc]:
    """``tracked`` plus the service, its process group and its descendants (a supervised child runs in a group of
    its own). Looked up only while the service process lives: after that its pid, and the group id, may be reused."""
    if is_alive(root):
        table = process_table()
        tracked = {root.pid: root, **tracked}
        tracked.update((p.pid, p) for p in table.values() if p.pgid == root.pid and not p.zombie)
        tracked.update((p.pid, p) for p in descendants(root.pid, table))
    return tracked


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of a process group: the service and every child it started."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, PermissionError, IndexError):
            continue
        if fields[2] == str(pgid) and fields[0] != "Z":
            members.append(int(entry.name))
    return members


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass
    except PermissionError:
        os.kill(pid, sig)


def _reap(pid: int) -> None:
    # Our own children (when the manager started them in this very process) must be waited for.
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def tail(path: Path, lines: int = 40) -> str:
    try:
        with path.open("rb") as f:
            return b"".join(deque(f, maxlen=lines)).decode(errors="replace")
    except FileNotFoundError:
        return f"(no log at {path})"


def dir_size(path: Path) -> int:
    """Bytes allocated on disk (Kafka preallocates sparse index files: their apparent size misleads)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += (Path(root) / name).stat().st_blocks * 512
            except FileNotFoundError:
                continue
    return total
