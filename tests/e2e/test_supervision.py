"""A dead worker or gateway is started again by its supervisor, nothing of a killed one is left behind, and
``kns stack down`` leaves nothing of a worker behind, not even after its worker process crashed.

Both run in a topic namespace of their own (``t<session>sup``, created and deleted here) with their own instance
ids and ports: the session's worker never shares its consumer group (and its partitions) with the worker that
these tests kill twice.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ops.stack.manager import StackManager
from runtime.kafka_clients import ensure_topics, make_admin
from runtime.reaper import Proc, descendants, is_alive, read_proc, terminate
from runtime.settings import Settings, load_settings
from schemas.topics import TOPICS
from tests.conftest import GATEWAY_PORT, SESSION, WORKER_ADMIN_PORT
from tests.helpers import ServiceProcess

pytestmark = pytest.mark.e2e
NAMESPACE = f"t{SESSION}sup"
OWN_WORKER_PORT = WORKER_ADMIN_PORT + 1
OWN_GATEWAY_PORT = GATEWAY_PORT + 2


@pytest.fixture(scope="module")
def own_env(stack: Settings, service_env: dict[str, str]) -> Iterator[dict[str, str]]:
    kafka = stack.kafka.model_copy(update={"namespace": NAMESPACE})
    asyncio.run(ensure_topics(kafka, TOPICS.all()))
    yield {**service_env, "KNS_KAFKA__NAMESPACE": NAMESPACE, "KNS_REDIS__KEY_PREFIX": f"kns-test-{SESSION}-sup:"}

    async def drop_topics() -> None:
        admin = make_admin(kafka)
        await admin.start()
        try:
            await admin.delete_topics([kafka.topic(t.name) for t in TOPICS.all()])
        finally:
            await admin.close()

    asyncio.run(drop_topics())


def cmdline(proc: Proc) -> str:
    try:
        return Path(f"/proc/{proc.pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except FileNotFoundError:
        return ""


def engine_processes(root: int) -> list[Proc]:
    """vLLM's processes below ``root``: its engine core (named VLLM::EngineCore) and the engine's workers."""
    return [p for p in descendants(root) if cmdline(p).startswith("VLLM::")]


def wait_gone(procs: list[Proc], timeout_s: float) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while (alive := [p for p in procs if is_alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [f"{p.pid} {cmdline(p)}" for p in alive]


def serving_child(service: ServiceProcess, module: str) -> int:
    """The supervisor's child that runs ``module`` (right after a crash its children also include what the dead
    one left behind, re-parented to it until it has stopped them)."""
    assert service.proc is not None
    children = [p for p in descendants(service.proc.pid) if p.ppid == service.proc.pid and module in cmdline(p)]
    assert len(children) == 1, [cmdline(p) for p in descendants(service.proc.pid)]
    return children[0].pid


def kill_supervisor(service: ServiceProcess) -> list[Proc]:
    """SIGKILL the supervisor alone (not its group), as the OOM killer would. Returns what ran below it."""
    assert service.proc is not None
    tree = descendants(service.proc.pid)
    os.kill(service.proc.pid, signal.SIGKILL)
    service.proc.wait(10)
    return tree


@pytest.fixture()
def leftovers() -> Iterator[list[Proc]]:
    """Processes a failing test may leave behind (an engine that outlived its worker): stopped afterwards, gently
    first (a SIGKILLed engine leaks its shared memory in /dev/shm)."""
    seen: list[Proc] = []
    yield seen
    terminate(seen, roots=seen, grace_s=10)


@pytest.mark.timeout(720)  # two vLLM worker starts, up to 300 s each
def test_a_killed_worker_takes_its_engine_along_and_is_started_again(own_env: dict[str, str],
                                                                     leftovers: list[Proc]) -> None:
    env = {**own_env, "KNS_WORKER__ADMIN_PORT": str(OWN_WORKER_PORT),
           "KNS_WORKER__INSTANCE_ID": f"test-worker-sup-{SESSION}"}
    service = ServiceProcess("worker-supervised", "worker", env, f"http://127.0.0.1:{OWN_WORKER_PORT}/health")
    service.start()
    assert service.proc is not None
    try:
        service.wait_healthy(300)
        engine = engine_processes(service.proc.pid)
        leftovers += engine
        assert any(cmdline(p).startswith("VLLM::EngineCore") for p in engine), descendants(service.proc.pid)
        worker = next(p for p in engine if cmdline(p).startswith("VLLM::EngineCore")).ppid

        # 1. The worker alone dies (not its group, not its supervisor): its engine goes with it.
        os.kill(worker, signal.SIGKILL)
        assert wait_gone(engine, 20) == [], f"the engine outlived its worker:\n{service.tail()}"

        # 2. The supervisor starts a new worker, which becomes healthy with an engine of its own.
        service.wait_healthy(300)
        new_worker = serving_child(service, "inference_workers.main")
        assert new_worker != worker and engine_processes(new_worker)
        assert "starting it again" in service.log_text()

        # 3. The supervisor dies by SIGKILL: nothing of its worker remains.
        tree = kill_supervisor(service)
        leftovers += tree
        assert any(cmdline(p).startswith("VLLM::") for p in tree)
        assert wait_gone(tree, 20) == []
    finally:
        service.stop()


@pytest.mark.timeout(300)  # two gateway starts, up to 120 s each
def test_a_killed_gateway_is_started_again_on_its_port(own_env: dict[str, str], leftovers: list[Proc]) -> None:
    env = {**own_env, "KNS_GATEWAY__PORT": str(OWN_GATEWAY_PORT),
           "KNS_GATEWAY__INSTANCE_ID": f"test-gateway-sup-{SESSION}"}
    health = f"http://127.0.0.1:{OWN_GATEWAY_PORT}/health"
    details = f"http://127.0.0.1:{OWN_GATEWAY_PORT + 50}/health"  # the partition is on the internal port only
    service = ServiceProcess("gateway-supervised", "gateway", env, health)
    service.start()
    assert service.proc is not None
    try:
        service.wait_healthy(120)
        partition = httpx.get(details).json()["reply_partition"]
        # The process that serves: the supervisor's child (before supervision, the command itself).
        gateway = (service.children() or [service.proc.pid])[0]
        killed = read_proc(gateway)
        assert killed is not None

        os.kill(gateway, signal.SIGKILL)
        assert wait_gone([killed], 5) == []
        service.wait_healthy(120)
        new_gateway = serving_child(service, "producers.gateway.main")
        assert new_gateway != gateway
        assert httpx.get(details).json()["reply_partition"] == partition  # its own partition back

        tree = kill_supervisor(service)
        leftovers += tree
        assert [p.pid for p in tree] == [new_gateway]
        assert wait_gone(tree, 10) == []
    finally:
        service.stop()


@pytest.mark.timeout(300)  # a vLLM worker's start through the stack manager, up to 180 s
def test_stack_down_leaves_nothing_of_a_crashed_worker_behind(own_env: dict[str, str], tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch,
                                                             leftovers: list[Proc]) -> None:
    # The stack manager's own services read this process's environment: a stack of our own under tmp_path.
    for name, value in own_env.items():
        if name.startswith("KNS_"):
            monkeypatch.setenv(name, value)
    monkeypatch.setenv("KNS_STACK__ROOT", str(tmp_path))
    monkeypatch.setenv("KNS_WORKER__ADMIN_PORT", str(OWN_WORKER_PORT))
    monkeypatch.setenv("KNS_WORKER__INSTANCE_ID", f"test-worker-stack-{SESSION}")
    manager = StackManager(load_settings())
    service = manager.service("worker")
    try:
        asyncio.run(manager._bring_up([service]))  # what `stack up` does for its app services, for this one only
        pid = manager.pid_file(service).live_pid()
        assert pid is not None
        root = read_proc(pid)
        assert root is not None
        tree = [root, *descendants(pid)]
        leftovers += tree
        engine_core = next(p for p in tree if cmdline(p).startswith("VLLM::EngineCore"))

        os.kill(engine_core.ppid, signal.SIGKILL)  # the worker process crashes ...
        assert manager.down(only=["worker"]) == ["worker"]  # ... and the stack is stopped at once
        assert wait_gone(tree, 0) == []
        assert not manager.pid_file(service).path.exists()
    finally:
        manager.down(only=["worker"])
