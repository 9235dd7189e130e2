"""A stop signal to the fleet (``runtime/fleet.py``) stops every copy, whatever the state it finds them in.

Two ways a Ctrl-C once failed to stop ``kns gateway --processes N``, each held here deterministically:

* the fleet was started with SIGINT ignored (a background job of a non-interactive shell is: ``./dev test > log &``).
  The ignored disposition survives fork and exec down to the copies, so the SIGINT each supervisor passed on was
  dropped, and every supervisor waited out its stop timeout (30 s) before killing its copy;
* the signal reached a supervisor that was still starting (before it blocked the signals it takes itself): it died of
  the KeyboardInterrupt, and the fleet exited with its code.

Copies are plain processes; each records its start, and a copy stopped by SIGINT records that too.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from runtime.reaper import descendants, read_proc, send
from runtime.settings import REPO_ROOT

# A supervisor that waits for the test's word before it starts supervising (as one importing its settings on a busy
# host does): it records its pid, then waits for the gate file to exist.
_HELD_SUPERVISOR = ("import os, sys, time\n"
                    "open(os.environ['HELD'], 'a').write(f'{os.getpid()}\\n')\n"
                    "while not os.path.exists(os.environ['GATE']):\n"
                    "    time.sleep(0.01)\n"
                    "from runtime.supervisor import main\n"
                    "main(sys.argv[1:])\n")


class FleetRun:
    def __init__(self, tmp_path: Path, copies: int, *, hold_supervisors: bool, sigint_ignored: bool) -> None:
        self.starts, self.stops = tmp_path / "starts", tmp_path / "stops"
        self.held, self.gate = tmp_path / "held", tmp_path / "gate"
        for path in (self.starts, self.stops, self.held):
            path.touch()
        child = (f"import os, time\ncopy = os.environ['COPY']\n"
                 f"open({str(self.starts)!r}, 'a').write(f'{{copy}} {{os.getpid()}}\\n')\n"
                 f"try:\n    time.sleep(300)\n"
                 f"except KeyboardInterrupt:\n    open({str(self.stops)!r}, 'a').write(f'{{copy}}\\n')\n    raise\n")
        fleet_class = "HeldFleet" if hold_supervisors else "Fleet"
        fleet = ("import os, sys\nfrom runtime.fleet import Fleet\n"
                 "class HeldFleet(Fleet):\n"
                 "    def _supervisor_command(self, index):\n"
                 "        name_and_service = super()._supervisor_command(index)[3:]\n"  # past -m runtime.supervisor
                 f"        return [sys.executable, '-c', {_HELD_SUPERVISOR!r}, *name_and_service]\n"
                 f"envs = [{{**os.environ, 'COPY': str(i)}} for i in range({copies})]\n"
                 f"sys.exit({fleet_class}('test', [sys.executable, '-c', {child!r}], envs).run())")
        self.log = (tmp_path / "fleet.log").open("ab")
        # A background job of a non-interactive shell starts with SIGINT (and SIGQUIT) ignored.
        ignore_sigint = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint_ignored else None
        self.proc = subprocess.Popen([sys.executable, "-c", fleet], cwd=REPO_ROOT, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=ignore_sigint,
                                     env={**os.environ, "KNS_SUPERVISOR__FIRST_DELAY_S": "0.2",
                                          "HELD": str(self.held), "GATE": str(self.gate)})

    def started(self) -> list[tuple[str, int]]:
        return [(copy, int(pid)) for copy, pid in (line.split() for line in self.starts.read_text().splitlines())]

    def stopped_by_sigint(self) -> list[str]:
        return sorted(self.stops.read_text().split())

    def held_supervisors(self) -> list[int]:
        return [int(pid) for pid in self.held.read_text().split()]

    def wait_for(self, predicate: Callable[[], object], timeout_s: float = 15) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            assert time.monotonic() < deadline, f"timed out; log:\n{self.log_text()}"
            assert self.proc.poll() is None, f"the fleet exited with {self.proc.returncode}:\n{self.log_text()}"
            time.sleep(0.02)

    def log_text(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def cleanup(self) -> None:
        tree = descendants(self.proc.pid)
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        for proc in tree:
            send(proc, signal.SIGKILL)
        self.log.close()


@pytest.fixture()
def fleet(tmp_path: Path) -> Iterator[Callable[..., FleetRun]]:
    started: list[FleetRun] = []

    def start(copies: int, *, hold_supervisors: bool = False, sigint_ignored: bool = False) -> FleetRun:
        started.append(FleetRun(tmp_path, copies, hold_supervisors=hold_supervisors, sigint_ignored=sigint_ignored))
        return started[-1]

    yield start
    for running in started:
        running.cleanup()


def _gone(pid: int) -> bool:
    proc = read_proc(pid)
    return proc is None or proc.zombie


def _pending_or_gone(pid: int, sig: signal.Signals) -> bool:
    """Whether ``sig`` waits for ``pid`` (sent, blocked, not yet taken), or ``pid`` has exited."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
    if fields.get("State", "").startswith("Z"):
        return True
    pending = int(fields["SigPnd"], 16) | int(fields["ShdPnd"], 16)
    return bool(pending & (1 << (sig - 1)))


def test_ctrl_c_stops_every_copy_as_ctrl_c_when_the_fleet_was_started_with_sigint_ignored(
        fleet: Callable[..., FleetRun]) -> None:
    running = fleet(2, sigint_ignored=True)
    running.wait_for(lambda: len(running.started()) == 2)
    os.killpg(running.proc.pid, signal.SIGINT)
    assert running.proc.wait(15) == 0, running.log_text()  # 0: no copy had to be killed after the stop timeout
    assert running.stopped_by_sigint() == ["0", "1"]  # each copy got the Ctrl-C, and could clean up on it
    assert all(_gone(pid) for _, pid in running.started())


def test_ctrl_c_that_reaches_supervisors_still_starting_stops_the_fleet_cleanly(
        fleet: Callable[..., FleetRun]) -> None:
    running = fleet(2, hold_supervisors=True)
    running.wait_for(lambda: len(running.held_supervisors()) == 2)
    os.killpg(running.proc.pid, signal.SIGINT)  # the fleet passes it on to supervisors that are not supervising yet
    supervisors = running.held_supervisors()
    deadline = time.monotonic() + 15
    while not all(_pending_or_gone(pid, signal.SIGINT) for pid in supervisors):
        assert time.monotonic() < deadline, f"the fleet never passed the signal on; log:\n{running.log_text()}"
        time.sleep(0.02)
    running.gate.touch()  # the supervisors carry on starting
    assert running.proc.wait(15) == 0, running.log_text()
    assert "Traceback" not in running.log_text()
    assert all(_gone(pid) for pid in supervisors)
    assert all(_gone(pid) for _, pid in running.started())
