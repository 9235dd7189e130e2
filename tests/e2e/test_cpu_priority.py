"""Our services yield the CPU to the engine (``cpu.yield_nice``, ``runtime/cpu_priority.py``): every thread of the
gateway, of the processors and of the worker's own process runs at the yielding nice level, and so do the
gateway's and the processors' sessions, while the vLLM engine's processes, started by the worker before it
yielded, and the worker's session stay at 0."""

from __future__ import annotations

import pytest

from bench.cpu import tree
from runtime.cpu_priority import autogroup_nice, thread_nice_levels
from runtime.reaper import read_proc
from runtime.settings import Settings
from tests.helpers import ServiceProcess

pytestmark = pytest.mark.e2e


def below(service: ServiceProcess) -> dict[int, str]:
    """pid → name of the processes below the service's supervisor (which starts its service at its own level)."""
    assert service.proc is not None
    return {pid: name for pid, (name, _) in tree(service.proc.pid).items() if pid != service.proc.pid}


def levels(pid: int) -> set[int]:
    return set(thread_nice_levels(pid).values())


def parent(pid: int) -> int:
    proc = read_proc(pid)
    assert proc is not None
    return proc.ppid


def test_the_engine_keeps_its_priority_and_the_worker_yields(worker: ServiceProcess, stack: Settings) -> None:
    processes = below(worker)
    engine = [pid for pid, name in processes.items() if name.startswith("VLLM::")]
    assert engine and all(levels(pid) == {0} for pid in engine), {processes[p]: levels(p) for p in engine}
    # The worker's own process: the engine core's parent (beside it idle helpers started before the engine).
    (core,) = [pid for pid in engine if processes[pid].startswith("VLLM::EngineCor")]
    assert levels(parent(core)) == {stack.cpu.yield_nice}
    # The worker's session holds its engine: its autogroup (what the scheduler weighs first) stays at 0.
    assert autogroup_nice(core) == autogroup_nice(parent(core)) == 0


def test_the_gateway_and_the_processors_yield(gateway: ServiceProcess, processors: dict[str, ServiceProcess],
                                              stack: Settings) -> None:
    nice = stack.cpu.yield_nice
    for service in (gateway, *processors.values()):
        found = {pid: levels(pid) for pid in below(service)}
        assert found and all(lv == {nice} for lv in found.values()), (service.name, found)
        # Alone in its session (its supervisor's): the session's autogroup yields too, or its threads' level
        # would count against nothing outside it.
        assert {autogroup_nice(pid) for pid in found} == {nice}, service.name
