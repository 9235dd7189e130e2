"""Second review of ``yield_session`` (commit a384112): where a session's autogroup is not raised though it should
be, and where one is raised that is not ours.

1. ``kns gateway --processes N`` (``runtime/fleet.py``): the session is the fleet's, the gateway's parent is its
   supervisor, so ``os.getsid(0) in (getpid, getppid)`` is never true: the gateways' threads sit at 10 inside an
   autogroup at 0, the case the commit set out to fix.
2. The kernel rate-limits autogroup writes of a process without CAP_SYS_ADMIN to one per 100 ms *system-wide*
   (``proc_sched_autogroup_set_nice``: ``-EAGAIN``). ``StackManager._bring_up`` starts Kafka, Cassandra and Redis
   back to back, so for a non-root ``kns stack up`` only the first gets its autogroup raised; processors and
   gateways starting together lose theirs the same way. ``yield_session`` takes the EAGAIN as "no autogroup".
3. ``getppid() == getsid(0)`` also holds for a process started by an interactive shell (the shell leads the
   terminal's session): ``python -m producers.gateway.main`` / ``python -m stream_processors.runner NAME`` run by
   hand, or the review's own ``test_a_yield_that_the_kernel_refuses_does_not_fail_the_service`` run by ``pytest``
   typed in a terminal, raise the terminal's session to 10, and a ``kns worker`` started from it later runs its
   engine in that autogroup.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import runtime.cpu_priority as cpu_priority
from runtime.settings import REPO_ROOT
from tests.unit.test_cpu_priority_review import needs_autogroups


def _nice(text: str) -> int:
    return int(text.split()[-1])  # "/autogroup-42 nice 10"


def _wait_for(path: Path, timeout_s: float = 20) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and (text := path.read_text()).strip():
            return text
        time.sleep(0.05)
    raise AssertionError(f"nothing in {path}")


def _kill_session(sid: int) -> None:
    """SIGKILL every process of session ``sid`` (one this test started with ``start_new_session``)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(proc.name), signal.SIGKILL)


# --- 1. the fleet ------------------------------------------------------------------------------------------------

LEAF = textwrap.dedent("""
    import sys, time
    from runtime.cpu_priority import yield_to_engines
    yield_to_engines(7, "gateway", session=True)
    open(sys.argv[1], "w").write(open("/proc/self/autogroup").read())
    time.sleep(60)
""")

FLEET = textwrap.dedent("""
    import os, sys
    from runtime.fleet import Fleet
    sys.exit(Fleet("gateway", [sys.executable, "-c", sys.argv[1], sys.argv[2]], [dict(os.environ)]).run())
""")


@needs_autogroups
def test_a_gateway_of_a_fleet_yields_its_session(tmp_path: Path) -> None:
    """``kns gateway --processes 2`` as the stack, the bench and tests/helpers start it (a session of its own,
    led by the fleet): fleet -> supervisor -> gateway. Nothing but gateways in that session, yet it stays at 0."""
    out = tmp_path / "autogroup.txt"
    fleet = subprocess.Popen([sys.executable, "-c", FLEET, LEAF, str(out)], cwd=REPO_ROOT, start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert _nice(_wait_for(out)) == 7
    finally:
        _kill_session(fleet.pid)
        fleet.wait(10)


# --- 2. the kernel's rate limit ----------------------------------------------------------------------------------

PROBES = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from ops.stack.manager import StackManager
    from ops.stack.services import RedisService
    from runtime.settings import CpuSettings, Settings, StackSettings

    root = Path(sys.argv[1])
    # A probe reads its autogroup once every start has returned (whatever the manager sets is set by then).
    PROBE = ("import os, sys, time\\nwhile not os.path.exists(sys.argv[2]): time.sleep(0.01)\\n"
             "open(sys.argv[1], 'w').write(open('/proc/self/autogroup').read())")

    def probe(name):
        class Probe(RedisService):
            def command(self):
                return [sys.executable, "-c", PROBE, str(root / f"{name}.txt"), str(root / "started")]
        Probe.name = name
        return Probe

    settings = Settings(stack=StackSettings(root=root), cpu=CpuSettings(yield_nice=7))
    manager = StackManager(settings)
    for name in ("kafka", "cassandra", "redis"):  # as _bring_up starts the infra: one after the other
        manager._start(probe(name)(settings))
    (root / "started").touch()
    files = [root / f"{n}.txt" for n in ("kafka", "cassandra", "redis")]
    deadline = time.monotonic() + 15
    while not all(f.exists() and f.read_text() for f in files) and time.monotonic() < deadline:
        time.sleep(0.01)
    print(" ".join(str(int((root / f"{n}.txt").read_text().split()[-1])) for n in ("kafka", "cassandra", "redis")))
""")


@needs_autogroups
def test_the_stacks_infra_all_yield_without_cap_sys_admin(tmp_path: Path) -> None:
    """A developer's ``kns stack up`` (not root): each infra service's autogroup raised in turn (three probes of
    the mechanism, all at ``yield_nice``; the broker's own level: ``test_cpu_priority_review.py``)."""
    prefix: list[str] = []
    if os.geteuid() == 0:  # root has CAP_SYS_ADMIN, which the rate limit spares: drop it as a user would lack it
        if shutil.which("setpriv") is None:
            pytest.skip("setpriv is needed to drop CAP_SYS_ADMIN")
        prefix = ["setpriv", "--bounding-set", "-sys_admin"]
    out = subprocess.run([*prefix, sys.executable, "-c", PROBES, str(tmp_path)], cwd=REPO_ROOT, capture_output=True,
                         text=True, check=True).stdout
    assert out.split() == ["7", "7", "7"], out


def test_a_rate_limited_autogroup_write_is_tried_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same without a kernel: EAGAIN says "not now" (the 100 ms limit), not "no autogroup here"."""
    state = {"nice": 0, "refusals": 1}

    class FakePath:
        def __init__(self, _path: str) -> None:
            pass

        def read_text(self) -> str:
            return f"/autogroup-1 nice {state['nice']}\n"

        def write_text(self, text: str) -> int:
            if state["refusals"]:
                state["refusals"] -= 1
                raise BlockingIOError(errno.EAGAIN, os.strerror(errno.EAGAIN))
            state["nice"] = int(text)
            return len(text)

    monkeypatch.setattr(cpu_priority, "Path", FakePath)
    assert cpu_priority.yield_session(12345, 10) is True
    assert state["nice"] == 10


# --- 3. a session that is not ours -------------------------------------------------------------------------------

@needs_autogroups
def test_a_service_run_by_hand_from_a_shell_leaves_the_shells_session_alone() -> None:
    """``python -m stream_processors.runner safety`` (or ``producers.gateway.main``) typed in a terminal: its
    parent, the shell, leads the session. The commit's own docstring says such a session must not be niced (the
    shell's other jobs, a ``kns worker`` and its engine among them, would run at 10)."""
    code = "from runtime.cpu_priority import yield_to_engines; yield_to_engines(7, 'processor-safety', session=True)"
    script = f"{sys.executable} -c \"{code}\"; cat /proc/self/autogroup"  # the shell runs it as its child
    out = subprocess.run(["bash", "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, check=True,
                         start_new_session=True).stdout
    assert _nice(out) == 0, out


@needs_autogroups
def test_the_unit_tests_leave_the_terminals_session_alone() -> None:
    """``pytest tests/unit`` typed in a terminal (pytest's parent leads the session): the review's refused-yield
    test calls ``yield_to_engines(..., session=True)`` in pytest's own process and raises the terminal's
    autogroup to 10 for as long as the terminal lives."""
    node = "tests/unit/test_cpu_priority_review.py::test_a_yield_that_the_kernel_refuses_does_not_fail_the_service"
    script = f"{sys.executable} -m pytest -q -p no:cacheprovider {node} >/dev/null; cat /proc/self/autogroup"
    out = subprocess.run(["bash", "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, check=True,
                         start_new_session=True).stdout
    assert _nice(out) == 0, out
