"""``stack up | down | status``: the local stack's lifecycle.

``up`` materialises jars, prepares the model, starts Kafka, Cassandra and Redis, waits for each to be healthy,
provisions topics / keyspace / dev key, then starts the worker and the gateway. Services already running
(by our PID files) are left alone, so ``up`` is idempotent. ``down`` stops exactly what ``up`` started, apps
first, and deletes data only when asked.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

from ops.model import ModelError, prepare_model
from ops.stack.jars import materialise_all
from ops.stack.process import PidFile, dir_size, spawn, stop, tail
from ops.stack.provision import provision
from ops.stack.services import Service, StackError, all_services, port_open
from runtime.cpu_priority import yield_session
from runtime.settings import REPO_ROOT, Settings

Report = Callable[[str], None]


@dataclass(frozen=True)
class ServiceStatus:
    name: str
    pid: int | None
    ports: list[int]
    healthy: bool
    data_bytes: int
    details: str


@dataclass(frozen=True)
class UpResult:
    started: list[str]
    already_running: list[str]
    topics_created: list[str]
    dev_key: str
    dev_key_new: bool


def _port_owner(port: int) -> str:
    ss = shutil.which("ss")
    if ss is None:
        return ""
    out = subprocess.run([ss, "-ltnpH", f"sport = :{port}"], capture_output=True, text=True).stdout
    return out.strip().split("users:")[-1] if "users:" in out else ""


class StackManager:
    def __init__(self, settings: Settings, report: Report = lambda _msg: None) -> None:
        self.settings = settings
        self.stack = settings.stack
        self.services = all_services(settings)
        self.report = report

    def pid_file(self, service: Service) -> PidFile:
        return PidFile(self.stack.run_dir / f"{service.name}.pid")

    def select(self, *, app: bool) -> list[Service]:
        return [s for s in self.services if s.infra or app]

    # --- up ---------------------------------------------------------------------------------------------

    def _preflight(self, services: list[Service]) -> None:
        self.stack.root.mkdir(parents=True, exist_ok=True)
        free_gb = shutil.disk_usage(self.stack.root).free / 1e9
        if free_gb < self.stack.min_free_disk_gb:
            raise StackError(
                f"only {free_gb:.1f} GB free under {self.stack.root}; the stack needs "
                f"{self.stack.min_free_disk_gb:.0f} GB (Kafka logs, Cassandra, the model)"
            )
        for service in services:
            if self.pid_file(service).live_pid() is not None:
                continue
            for port in service.ports():
                if port_open(port):
                    owner = _port_owner(port)
                    raise StackError(
                        f"port {port} (needed by {service.name}) is already in use"
                        + (f" by {owner}" if owner else "")
                        + "; stop that process or point the setting at a free port"
                    )

    def _start(self, service: Service) -> bool:
        """Start one service unless it is already running. True if it was started now."""
        pid_file = self.pid_file(service)
        if pid_file.live_pid() is not None:
            return False
        service.prepare()
        command, nice = service.command(), service.nice()
        # The stores (and the broker, at its own level) yield to an engine on this host, as our services do
        # themselves: each thread (``nice`` adds to this process's level) and the session the spawn gives them.
        by = nice - os.getpriority(os.PRIO_PROCESS, 0)
        if service.infra and by > 0:
            command = ["nice", "-n", str(by), *command]
        pid = spawn(command, log_file=service.log_file, pid_file=pid_file, env=service.env(), cwd=REPO_ROOT)
        if service.infra and nice:
            yield_session(pid, nice)
        return True

    async def _wait_healthy(self, service: Service) -> None:
        deadline = time.monotonic() + self.stack.start_timeout_s
        pid_file = self.pid_file(service)
        while time.monotonic() < deadline:
            if pid_file.live_pid() is None:
                raise StackError(
                    f"{service.name} exited during start-up. Last lines of {service.log_file}:\n"
                    + tail(service.log_file)
                )
            if await service.healthy():
                return
            await asyncio.sleep(0.5)
        raise StackError(
            f"{service.name} did not become healthy within {self.stack.start_timeout_s:.0f} s. "
            f"Last lines of {service.log_file}:\n" + tail(service.log_file)
        )

    async def _bring_up(self, services: list[Service]) -> tuple[list[str], list[str]]:
        started: list[str] = []
        running: list[str] = []
        for service in services:
            # In a thread: a refused autogroup change is tried again for up to 2 s (runtime/cpu_priority.py)
            (started if await asyncio.to_thread(self._start, service) else running).append(service.name)
        waits = [self._wait_healthy(s) for s in services]
        results = await asyncio.gather(*waits, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return started, running

    async def up(self, *, app: bool = True) -> UpResult:
        services = self.select(app=app)
        self._preflight(services)
        self.report("resolving the Kafka and Cassandra jars (Maven)")
        await asyncio.to_thread(materialise_all, self.stack)
        if app:
            self.report(f"preparing the model in {self.settings.model.path}")
            try:
                await asyncio.to_thread(prepare_model, self.settings.model.path)
            except ModelError as exc:
                raise StackError(str(exc)) from exc
        infra = [s for s in services if s.infra]
        self.report("starting " + ", ".join(s.name for s in infra))
        started, running = await self._bring_up(infra)
        self.report("creating topics, keyspace and the dev API key")
        topics, secret, new = await provision(self.settings)
        for wave in sorted({getattr(s, "wave", 0) for s in services if not s.infra}):
            apps = [s for s in services if not s.infra and getattr(s, "wave", 0) == wave]
            self.report("starting " + ", ".join(s.name for s in apps)
                        + (" (the engine takes ~30 s on a CPU)" if any(s.name == "worker" for s in apps) else ""))
            app_started, app_running = await self._bring_up(apps)
            started += app_started
            running += app_running
        return UpResult(started, running, topics, secret, new)

    # --- down -------------------------------------------------------------------------------------------

    def down(self, *, wipe: bool = False, only: list[str] | None = None) -> list[str]:
        stopped = []
        for service in reversed(self.services):
            if only and service.name not in only:
                continue
            self.report(f"stopping {service.name}")
            # An app is a supervisor that gives its child 30 s (a worker drains its requests), then up to 12 s to
            # what the child leaves behind: 45 s covers both before the stack SIGKILLs what remains.
            if stop(self.pid_file(service), timeout_s=60 if service.infra else 45):
                stopped.append(service.name)
        if wipe:
            stack = self.stack
            for path in (stack.data_dir, stack.logs_dir, stack.dev_key_file, stack.dev_admin_key_file):
                self.report(f"deleting {path}")
                if path.is_dir():
                    shutil.rmtree(path)
                else:
                    path.unlink(missing_ok=True)
        return stopped

    # --- status -----------------------------------------------------------------------------------------

    async def status(self) -> list[ServiceStatus]:
        async def one(service: Service) -> ServiceStatus:
            pid = self.pid_file(service).live_pid()
            healthy = await service.healthy() if pid is not None else False
            size = dir_size(service.data_dir) if service.data_dir.exists() else 0
            return ServiceStatus(service.name, pid, service.ports(), healthy, size, service.details())

        return list(await asyncio.gather(*(one(s) for s in self.services)))

    def service(self, name: str) -> Service:
        for service in self.services:
            if service.name == name:
                return service
        raise StackError(f"no service named {name!r}; services: {', '.join(s.name for s in self.services)}")
