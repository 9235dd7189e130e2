"""The fleet (``runtime/fleet.py``): several supervised copies of one command, with plain processes as copies.

Each copy appends ``<its COPY variable> <pid>`` to a file when it starts; what it does then is the test's.
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


class Running:
    def __init__(self, tmp_path: Path, body: str, copies: int) -> None:
        self.starts = tmp_path / "starts"
        self.starts.touch()
        starts = str(self.starts)
        child = (f"import os, signal, sys, time\nopen({starts!r}, 'a').write(f'{{os.environ[\"COPY\"]}} "
                 f"{{os.getpid()}}\\n')\ncopy = os.environ['COPY']\n{body}")
        fleet = ("import os, sys\nfrom runtime.fleet import Fleet\n"
                 f"envs = [{{**os.environ, 'COPY': str(i)}} for i in range({copies})]\n"
                 f"sys.exit(Fleet('test', [sys.executable, '-c', {child!r}], envs).run())")
        self.log = (tmp_path / "fleet.log").open("ab")
        self.proc = subprocess.Popen([sys.executable, "-c", fleet], cwd=REPO_ROOT, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, "KNS_SUPERVISOR__FIRST_DELAY_S": "0.2"})

    def started(self) -> list[tuple[str, int]]:
        return [(copy, int(pid)) for copy, pid in (line.split() for line in self.starts.read_text().splitlines())]

    def wait_for(self, predicate: Callable[[], object], timeout_s: float = 15) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            assert time.monotonic() < deadline, f"timed out; log:\n{self.log_text()}"
            assert self.proc.poll() is None, f"the fleet exited with {self.proc.returncode}:\n{self.log_text()}"
            time.sleep(0.05)

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
def fleet(tmp_path: Path) -> Iterator[Callable[[str, int], Running]]:
    started: list[Running] = []

    def start(body: str, copies: int) -> Running:
        started.append(Running(tmp_path, body, copies))
        return started[-1]

    yield start
    for running in started:
        running.cleanup()


def _gone(pid: int) -> bool:
    proc = read_proc(pid)
    return proc is None or proc.zombie


def _wait_gone(pids: list[int], timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(_gone(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(_gone(pid) for pid in pids)


def test_every_copy_runs_with_its_own_environment_and_a_stop_signal_stops_them_all(
        fleet: Callable[[str, int], Running]) -> None:
    running = fleet("time.sleep(300)", 3)
    running.wait_for(lambda: len(running.started()) == 3)
    assert sorted(copy for copy, _ in running.started()) == ["0", "1", "2"]
    os.killpg(running.proc.pid, signal.SIGINT)  # a terminal's Ctrl-C: the fleet's group only
    assert running.proc.wait(15) == 0, running.log_text()
    _wait_gone([pid for _, pid in running.started()])


def test_a_copy_that_dies_is_restarted_alone(fleet: Callable[[str, int], Running]) -> None:
    running = fleet("time.sleep(300)", 2)
    running.wait_for(lambda: len(running.started()) == 2)
    first = dict(running.started())
    os.kill(first["1"], signal.SIGKILL)
    running.wait_for(lambda: len(running.started()) == 3)
    assert running.started()[2][0] == "1"
    assert not _gone(first["0"])  # the other copy was left alone
    os.kill(running.proc.pid, signal.SIGTERM)
    assert running.proc.wait(15) == 0, running.log_text()


def test_a_copy_whose_configuration_is_wrong_stops_the_fleet_with_its_code(
        fleet: Callable[[str, int], Running]) -> None:
    running = fleet(f"if copy == '1':\n    sys.exit({os.EX_CONFIG})\ntime.sleep(300)", 2)
    assert running.proc.wait(15) == os.EX_CONFIG, running.log_text()
    _wait_gone([pid for _, pid in running.started()])
    assert "stopping the fleet" in running.log_text()


def test_a_killed_fleet_takes_every_copy_along(fleet: Callable[[str, int], Running]) -> None:
    running = fleet("time.sleep(300)", 2)
    running.wait_for(lambda: len(running.started()) == 2)
    os.kill(running.proc.pid, signal.SIGKILL)  # the fleet alone: its supervisors lead groups of their own
    running.proc.wait(5)
    _wait_gone([pid for _, pid in running.started()])
