"""A benchmark killed with SIGTERM stops what it started: its ``finally`` blocks run, as on Ctrl-C."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

PROGRAM = textwrap.dedent("""
    import asyncio, sys, time
    from pathlib import Path
    {setup}

    async def bench():
        try:
            print("ready", flush=True)
            await asyncio.sleep(60)
        finally:
            print("stopping", flush=True)
            for service in ("vllm-server", "worker"):  # each stop takes a while, as a real server's does
                time.sleep(0.5)
                (Path(sys.argv[1]) / service).write_text("stopped")

    asyncio.run(bench())
""")
SETUP = "from bench.common import stop_cleanly_on_sigterm; stop_cleanly_on_sigterm()"


def _killed(tmp_path: Path, setup: str, *, again: bool = False) -> tuple[int, set[str]]:
    proc = subprocess.Popen([sys.executable, "-c", PROGRAM.format(setup=setup), str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        if again:
            assert proc.stdout.readline().strip() == "stopping"
            proc.send_signal(signal.SIGTERM)  # a CI cancel sends more than one
        return proc.wait(timeout=30), {p.name for p in tmp_path.iterdir()}
    finally:
        proc.kill()


def test_sigterm_runs_the_cleanup(tmp_path: Path) -> None:
    code, stopped = _killed(tmp_path, SETUP)
    assert stopped == {"vllm-server", "worker"}
    assert code != 0


def test_a_second_sigterm_does_not_cut_the_cleanup_short(tmp_path: Path) -> None:
    code, stopped = _killed(tmp_path, SETUP, again=True)
    assert stopped == {"vllm-server", "worker"}
    assert code != 0


def test_without_it_python_dies_without_cleaning_up(tmp_path: Path) -> None:
    """The control: what the handler is for."""
    code, stopped = _killed(tmp_path, "")
    assert not stopped
    assert code == -signal.SIGTERM


def test_the_bench_commands_install_it() -> None:
    from typer.testing import CliRunner

    from ops.cli import app

    previous = signal.getsignal(signal.SIGTERM)
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        CliRunner().invoke(app, ["bench", "billing", "--events", "1"])  # refused (min 1000) after the callback ran
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, previous)
