"""The two sides of a comparison, as processes this benchmark starts and stops.

* vLLM's own OpenAI-compatible server (``python -m vllm.entrypoints.openai.api_server``) with the engine arguments
  our worker uses (``inference_workers.engine.engine_args``), turned into its flags;
* our pipeline: one worker and one gateway in a namespace of their own (fresh topics), on the running Kafka,
  Cassandra and Redis. The safety pre-filter is off there, so that the comparison measures the Kafka path itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from inference_workers.engine import engine_args, engine_env
from ops.stack.manager import StackManager
from ops.stack.process import PidFile, spawn, stop, tail
from producers.tenancy.admin import UNLIMITED, KeyCreate, open_admin
from runtime.kafka_clients import ensure_topics
from runtime.settings import REPO_ROOT, Settings
from schemas.topics import TOPICS

RUN_DIR = REPO_ROOT / ".local" / "bench"


def vllm_flags(args: dict[str, Any]) -> list[str]:
    flags = []
    for name, value in args.items():
        if name == "model":
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else f"--no-{name.replace('_', '-')}")
        elif isinstance(value, dict):
            import json

            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    return flags


@dataclass
class Proc:
    name: str
    cmd: list[str]
    env: dict[str, str]
    health: str
    pid_file: PidFile = field(init=False)
    log: Path = field(init=False)

    def __post_init__(self) -> None:
        self.pid_file = PidFile(RUN_DIR / f"{self.name}.pid")
        self.log = RUN_DIR / f"{self.name}.log"

    def start(self) -> None:
        if self.pid_file.live_pid() is not None:
            stop(self.pid_file)
        self.log.unlink(missing_ok=True)
        spawn(self.cmd, log_file=self.log, pid_file=self.pid_file, env=self.env, cwd=REPO_ROOT)

    async def wait(self, timeout_s: float = 600) -> None:
        def alive() -> None:
            if self.pid_file.live_pid() is None:
                raise RuntimeError(f"{self.name} exited:\n{tail(self.log)}")

        if not await wait_healthy(self.health, timeout_s, alive, every_s=1):
            raise RuntimeError(f"{self.name} not healthy in {timeout_s} s:\n{tail(self.log)}")

    def stop(self) -> None:
        stop(self.pid_file)

    @property
    def pid(self) -> int | None:
        return self.pid_file.live_pid()


@dataclass
class Side:
    label: str
    base_url: str
    api_key: str
    procs: list[Proc]
    description: str
    #: the services' Prometheus endpoints whose stage histograms say where a request's time went (ours only)
    metrics_urls: list[str] = field(default_factory=list)


def vllm_side(settings: Settings, port: int) -> Side:
    args = engine_args(settings.model, settings.engine)
    # The engine's environment as our worker gives it (its processes' idle spin): the same engine on both sides.
    same_engine = engine_env(settings.engine)
    env = {**os.environ, "VLLM_CACHE_ROOT": str(settings.engine.effective().cache_dir), "PYTHONUNBUFFERED": "1",
           **same_engine}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(args["model"]),
           "--host", "127.0.0.1", "--port", str(port), "--disable-uvicorn-access-log", *vllm_flags(args)]
    proc = Proc("vllm-server", cmd, env, f"http://127.0.0.1:{port}/health")
    return Side("vllm", f"http://127.0.0.1:{port}/v1", "none", [proc],
                "vLLM's OpenAI server (1 API process + 1 engine-core process): " + " ".join(cmd[3:])
                + "".join(f"; {name}={value}" for name, value in same_engine.items()))


async def pipeline(settings: Settings, *, namespace: str, gateway_port: int, worker_port: int, prefix: str,
                   extra_env: dict[str, str] | None = None, gateway_processes: int = 1, workers: int = 1,
                   gateway_cpus: str = "", worker_cpus: str = "") -> tuple[str, list[Proc]]:
    """Workers and a gateway of ours in a namespace of their own (fresh topics, a new bench API key), safety
    pre-filter off. Returns the key's secret and the processes (not started), the gateway last.
    ``gateway_processes``: the gateway's processes (``kns gateway --processes``; process i answers on
    ``gateway_port + 50 + i`` alone); worker i's admin port is ``worker_port + i``; ``*_cpus``: a ``taskset`` CPU
    list each is pinned to (empty: not pinned)."""
    kafka = settings.kafka.model_copy(update={"namespace": namespace})
    await ensure_topics(kafka, TOPICS.all())
    async with open_admin(settings.model_copy(update={"kafka": kafka})) as admin:
        secret = (await admin.issue_key("org-bench", "enterprise", KeyCreate(name=prefix), limits=UNLIMITED)).secret
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "KNS_KAFKA__NAMESPACE": namespace,
           "KNS_SAFETY__PREFILTER": "false", "KNS_GATEWAY__PORT": str(gateway_port),
           "KNS_GATEWAY__INSTANCE_ID": f"{prefix}-gateway-{namespace}", "KNS_WORKER__ADMIN_PORT": str(worker_port),
           "KNS_WORKER__INSTANCE_ID": f"{prefix}-worker-{namespace}", **(extra_env or {})}
    procs = [Proc(f"{prefix}-worker" + (f"-{i}" if i else ""),
                  [*pinned(worker_cpus), sys.executable, "-m", "ops.cli", "worker"],
                  {**env, "KNS_WORKER__ADMIN_PORT": str(worker_port + i),
                   "KNS_WORKER__INSTANCE_ID": f"{prefix}-worker-{namespace}" + (f"-{i}" if i else "")},
                  f"http://127.0.0.1:{worker_port + i}/health") for i in range(workers)]
    gateway = Proc(f"{prefix}-gateway", [*pinned(gateway_cpus), sys.executable, "-m", "ops.cli", "gateway",
                                         "--processes", str(gateway_processes)], env,
                   # the last process's own port: the others started at the same moment
                   f"http://127.0.0.1:{gateway_port + 50 + gateway_processes - 1}/health" if gateway_processes > 1
                   else f"http://127.0.0.1:{gateway_port}/health")
    return secret, [*procs, gateway]


async def wait_healthy(url: str, timeout_s: float, alive: Callable[[], None] | None = None,
                       every_s: float = 0.5) -> bool:
    """Poll a health URL until it answers 200 (True) or ``timeout_s`` passes (False); ``alive`` raises when
    what should answer is gone."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=3) as client:
        while time.monotonic() < deadline:
            if alive is not None:
                alive()
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get(url)).status_code == 200:
                    return True
            await asyncio.sleep(every_s)
    return False


def pinned(cpus: str) -> list[str]:
    """A command prefix that pins what it runs (and its children) to ``cpus`` (``taskset -c`` syntax)."""
    return ["taskset", "-c", cpus] if cpus else []


def pin_threads(pids: dict[str, int], cpus: set[int]) -> None:
    """Pin every thread of running processes (the JVMs' too) to ``cpus``."""
    for pid in pids.values():
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.sched_setaffinity(int(task.name), cpus)


def infra_pids(settings: Settings) -> dict[str, int]:
    """Kafka, Cassandra and Redis of the running stack, by name (for the CPU meters)."""
    manager = StackManager(settings)
    return {sv.name: pid for sv in manager.services if sv.infra and (pid := manager.pid_file(sv).live_pid())}


async def our_side(settings: Settings, gateway_port: int, worker_port: int, namespace: str) -> Side:
    secret, procs = await pipeline(settings, namespace=namespace, gateway_port=gateway_port,
                                   worker_port=worker_port, prefix="bench")
    args = engine_args(settings.model, settings.engine)
    return Side("ours", f"http://127.0.0.1:{gateway_port}/v1", secret, procs,
                f"kns gateway + Kafka + worker (1 gateway process, 1 worker process + 1 engine-core process), "
                f"namespace {namespace}, safety pre-filter off; our processes (and the stack's Cassandra and Redis) "
                f"at nice {settings.cpu.yield_nice}, threads and sessions, the stack's Kafka at "
                f"{settings.cpu.kafka_nice}, the engine's at 0; engine {args}"
                + "".join(f"; {name}={value}" for name, value in engine_env(settings.engine).items()),
                metrics_urls=[f"http://127.0.0.1:{gateway_port + 50}/metrics",  # the gateway's internal port
                              f"http://127.0.0.1:{worker_port}/metrics"])
