"""Review of ``runtime/cpu_priority.py`` and ``cpu.yield_nice``: what the change claims and does not do.

1. Autogroups. With ``kernel.sched_autogroup_enabled=1`` and processes in the root CPU cgroup (this dev box: cgroup
   v1 ``cpu:/``), a thread's nice level weighs only against threads of the same *session* (man 7 sched, "The nice
   value and group scheduling"). The stack (``ops/stack/process.py`` ``spawn``: ``start_new_session=True``), the
   bench and ``tests/helpers.py`` start every service in a session of its own, so Kafka, Cassandra, Redis, the
   gateway and the processors each got an autogroup at nice 0 whatever their threads' level: against the engine's
   autogroup their yielding changed nothing. Only the worker's yield (same session as its engine) took effect.
   Now the gateway and the processors raise their session's autogroup, and the stack raises the infra's.
2. A yield that lowers a level: as root (containers, this box) ``renice`` sets a thread started above ``nice``
   *down* to it, i.e. raises its priority, possibly above the engine's.
3. A best-effort tuning that can fail a service's start: an ``OSError`` other than EPERM/ESRCH escapes.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import runtime.cpu_priority as cpu_priority
from ops.stack.manager import StackManager
from ops.stack.services import CassandraService, KafkaService, RedisService, WorkerService
from runtime.settings import REPO_ROOT, CpuSettings, Settings, StackSettings


def _autogroups_in_effect() -> bool:
    """Whether the scheduler groups this host's tasks by session (autogroup): enabled, and the CPU cgroup is the
    root one (a task in another CPU cgroup is grouped by that cgroup instead)."""
    try:
        if Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() != "1":
            return False
        Path("/proc/self/autogroup").read_text()
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return False
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(","):  # cgroup v1
            return path == "/"
    for line in lines:
        if line.startswith("0::"):  # cgroup v2: grouped by the cgroup when the cpu controller runs there
            path = line[3:]
            if path == "/":
                return True
            parent = Path("/sys/fs/cgroup") / path.lstrip("/")
            try:
                return "cpu" not in (parent.parent / "cgroup.subtree_control").read_text().split()
            except OSError:
                return False
    return True


needs_autogroups = pytest.mark.skipif(not _autogroups_in_effect(), reason="no autogroup scheduling on this host")


def _autogroup_nice(text: str) -> int:
    # "/autogroup-1258 nice 0"
    return int(text.split()[-1])


# --- 1. autogroups -----------------------------------------------------------------------------------------------

@needs_autogroups
def test_a_yielding_process_alone_in_its_session_yields_its_autogroup() -> None:
    """The gateway and the processors run alone in their session (their supervisor leads it, started with
    ``start_new_session``) and have started nothing when they yield: their autogroup, what the engine's autogroup
    competes with, must be at ``nice``; threads at 10 inside an autogroup at 0 yield to nobody outside it."""
    code = ("import os; from runtime.cpu_priority import SESSION_ENV, yield_to_engines; "
            "os.environ[SESSION_ENV] = str(os.getsid(0)); yield_to_engines(7, 'gateway', session=True); "
            "print(open('/proc/self/autogroup').read(), flush=True)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True,
                         start_new_session=True).stdout
    assert _autogroup_nice(out) == 7, out


PROBE = textwrap.dedent("""
    import os, sys, time
    while not os.path.exists(sys.argv[2]):  # the manager's start has returned: whatever it sets is set
        time.sleep(0.01)
    autogroup = open("/proc/self/autogroup").read() if os.path.exists("/proc/self/autogroup") else "none -1"
    with open(sys.argv[1], "w") as out:
        out.write(f"{os.getpriority(os.PRIO_PROCESS, 0)} {autogroup}")
""")


def _probe_autogroup(tmp_path: Path, service_class: type, yield_nice: int = 7, kafka_nice: int = 0) -> int:
    """The autogroup nice level a service the stack manager starts runs at (its command swapped for a probe)."""
    return _probe_levels(tmp_path, service_class, yield_nice, kafka_nice)[1]


def _probe_levels(tmp_path: Path, service_class: type, yield_nice: int = 7, kafka_nice: int = 0
                  ) -> tuple[int, int]:
    """The nice levels of a service the stack manager starts: its thread's, its autogroup's (-1: none here)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    out, started = tmp_path / "autogroup.txt", tmp_path / "started"

    class Probe(service_class):  # type: ignore[misc, valid-type]
        def prepare(self) -> None:
            self.data_dir.mkdir(parents=True, exist_ok=True)

        def command(self) -> list[str]:
            return [sys.executable, "-c", PROBE, str(out), str(started)]

    settings = Settings(stack=StackSettings(root=tmp_path),  # type: ignore[arg-type]
                        cpu=CpuSettings(yield_nice=yield_nice, kafka_nice=kafka_nice))
    manager = StackManager(settings)
    assert manager._start(Probe(settings))
    started.touch()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if out.exists() and out.read_text():
            thread, autogroup = out.read_text().split(maxsplit=1)
            return int(thread), _autogroup_nice(autogroup)
        time.sleep(0.05)
    raise AssertionError(f"the probe wrote nothing; its log:\n{Probe(settings).log_file.read_text()}")


@needs_autogroups
def test_the_stacks_infra_yields_in_its_autogroup(tmp_path: Path) -> None:
    """``nice -n`` (ops/stack/manager.py) sets the threads' level inside a fresh session's autogroup at 0: Redis
    (Kafka, Cassandra alike) still weighs as much as the engine's autogroup."""
    assert _probe_autogroup(tmp_path, RedisService) == 7


@needs_autogroups
def test_guard_the_stacks_worker_keeps_its_autogroup_at_0(tmp_path: Path) -> None:
    """Guard for the fix (passes today): the worker's session holds its engine; its autogroup must stay at 0."""
    assert _probe_autogroup(tmp_path, WorkerService) == 0


@needs_autogroups
def test_guard_a_process_that_started_its_engine_leaves_the_autogroup_alone() -> None:
    """Guard for the fix (passes today): the worker yields after its engine started, in the same session; a fix
    that nices the autogroup there would nice the engine with it."""
    code = textwrap.dedent("""
        import subprocess, sys
        engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        from runtime.cpu_priority import yield_to_engines
        yield_to_engines(7, "worker", session=False)
        print(open(f"/proc/{engine.pid}/autogroup").read(), flush=True)
        engine.kill()
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True,
                         start_new_session=True).stdout
    assert _autogroup_nice(out) == 0, out


# --- 2. a yield never raises a priority --------------------------------------------------------------------------

def test_a_yield_never_lowers_a_level_already_above_it() -> None:
    """A process started at nice 15 (``nice -n 15 kns worker``: its engine at 15 too) that yields to 10 must stay
    at 15. As root (CAP_SYS_NICE: containers, this dev box) ``renice`` sets it to 10: the worker's loop then
    outranks its own engine, the opposite of the intent. Unprivileged, EACCES keeps 15 (and the test passes)."""
    code = ("import os; from runtime.cpu_priority import yield_to_engines; "
            "yield_to_engines(10, 'worker', session=False); print(os.getpriority(os.PRIO_PROCESS, 0), flush=True)")
    out = subprocess.run(["nice", "-n", "15", sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                         text=True, check=True).stdout
    base = os.getpriority(os.PRIO_PROCESS, 0)
    assert int(out) == min(19, base + 15), out


# --- 3. never fatal ----------------------------------------------------------------------------------------------

def test_a_yield_that_the_kernel_refuses_does_not_fail_the_service(monkeypatch: pytest.MonkeyPatch) -> None:
    """setpriority refused with an errno other than EPERM/EACCES/ESRCH (a seccomp profile answering ENOSYS, a
    sandbox): ``yield_to_engines`` raises, and the gateway, a processor or the worker (after loading its engine)
    dies at start, restarted by its supervisor in a loop (exit 1 is not a permanent code)."""
    def refused(*_args: object) -> None:
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))

    monkeypatch.setattr(cpu_priority.os, "setpriority", refused)
    monkeypatch.delenv(cpu_priority.SESSION_ENV, raising=False)  # never the test runner's own session
    monkeypatch.setattr(cpu_priority.os, "getpriority", lambda *_a: 0)
    cpu_priority.yield_to_engines(10, "gateway", session=True)  # must not raise: a tuning, not a condition to serve


# --- guard: the order in the worker (only e2e covers it today) ----------------------------------------------------

def test_guard_the_worker_yields_only_after_its_engine_started(monkeypatch: pytest.MonkeyPatch) -> None:
    """Passes today. The engine's processes inherit the level of the thread that spawns them: a refactor that moves
    the yield above ``VllmEngine.start`` nices the engine, and only tests/e2e (a real vLLM) would notice."""
    import asyncio

    import inference_workers.main as worker_main

    calls: list[object] = []

    class Stop(Exception):
        pass

    def start(_cls: type, _model: object, _engine: object) -> object:
        calls.append("engine")
        return object()

    def worker(*_args: object) -> None:
        raise Stop

    monkeypatch.setattr(worker_main.VllmEngine, "start", classmethod(start))
    monkeypatch.setattr(worker_main, "yield_to_engines",
                        lambda nice, service, session: calls.append(("yield", nice, session)))
    monkeypatch.setattr(worker_main, "Worker", worker)
    with pytest.raises(Stop):
        asyncio.run(worker_main.serve(Settings()))
    assert calls == ["engine", ("yield", 10, False)]


def test_the_stacks_broker_runs_at_its_own_level(tmp_path: Path) -> None:
    """``cpu.kafka_nice``: every request and token crosses the broker twice, so it waits behind none of our
    Python; the stores (Redis, Cassandra) keep ``yield_nice``. Threads and autogroup (where there is one) alike;
    levels are only ever raised, so a thread stays at this test's own level when that is higher."""
    base = os.getpriority(os.PRIO_PROCESS, 0)
    autogroups = _autogroups_in_effect()
    for name, service, kafka_nice, level in (("kafka", KafkaService, 3, 3), ("cassandra", CassandraService, 3, 7),
                                             ("kafka-at-0", KafkaService, 0, 0)):
        thread, autogroup = _probe_levels(tmp_path / name, service, yield_nice=7, kafka_nice=kafka_nice)
        assert thread == max(base, level), (name, thread)
        if autogroups:
            assert autogroup == level, (name, autogroup)
