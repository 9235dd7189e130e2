"""Renicing a process reaches every thread it has and every thread it starts afterwards (Linux keeps the level
per thread); a process that yields raises its own level only."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from runtime.cpu_priority import renice, thread_nice_levels

CHILD = textwrap.dedent("""
    import os, sys, threading
    stop = threading.Event()
    for _ in range(3):
        threading.Thread(target=stop.wait, daemon=True).start()
    print("ready", flush=True)
    sys.stdin.readline()
    level = []
    later = threading.Thread(target=lambda: level.append(os.getpriority(os.PRIO_PROCESS, 0)))
    later.start(); later.join()
    print(level[0], flush=True)
""")


def test_renice_reaches_every_thread_and_those_started_later() -> None:
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline().strip() == "ready"
        base = os.getpriority(os.PRIO_PROCESS, 0)  # this test's own level (a developer may run it niced)
        target = min(19, base + 7)
        assert len(thread_nice_levels(child.pid)) == 4 and set(thread_nice_levels(child.pid).values()) == {base}
        assert renice(child.pid, target) == 4
        assert set(thread_nice_levels(child.pid).values()) == {target}
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == str(target)
    finally:
        child.kill()
        child.wait()


def test_a_process_gone_is_reniced_nowhere() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert renice(child.pid, 5) == 0
