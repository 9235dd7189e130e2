"""The stack a chaos run breaks: its own namespace, Redis, workers, gateways and billing processor.

Everything but Kafka and Cassandra is the run's own, so its faults never touch a dev stack on the same machine:
topics in a fresh namespace, a Redis server without persistence (restarting it loses every key, as a Redis
without persistence or a failover does), an organisation and API key of its own. Kafka and Cassandra are the
local stack's (the broker and Cassandra scenarios restart or stop those for everyone, on purpose).

Workers use the synthetic engine by default: tokens are a function of their context, so every received stream is
checked token by token against what an uninterrupted generation gives (``audit.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.servers import Proc
from ops.stack.manager import StackManager
from ops.stack.provision import apply_schema
from ops.stack.services import REDIS_MAXMEMORY, REDIS_MAXMEMORY_POLICY
from producers.tenancy.admin import UNLIMITED, KeyCreate, open_admin
from runtime.kafka_clients import ensure_topics, make_admin
from runtime.settings import REPO_ROOT, RedisSettings, Settings
from schemas.topics import TOPICS

RUN_ROOT = REPO_ROOT / ".local" / "chaos"
#: how a Faust worker's process retitles itself (a stream processor's service process)
FAUST_TITLE = b"[Faust:Worker]"


@dataclass
class Ports:
    base: int = 17500

    def gateway(self, i: int) -> int:
        return self.base + i

    def worker(self, i: int) -> int:
        return self.base + 10 + i

    @property
    def billing(self) -> int:
        return self.base + 30

    @property
    def store(self) -> int:
        return self.base + 31

    @property
    def redis(self) -> int:
        return self.base + 40


@dataclass
class Knobs:
    """How the run's services are configured (small timeouts so that scenarios are short)."""

    engine: str = "synthetic"
    tokens_per_s: float = 20.0
    max_seqs: int = 16
    queue_deadline_s: float = 60.0
    first_token_grace_s: float = 30.0
    session_timeout_ms: int = 6000
    #: the workers' Redis lease (``inference_workers/liveness.py``); 0: the session timeout alone finds a dead one
    liveness_ttl_s: float = 1.0
    #: any other settings of the run's services (``KNS_...`` variables)
    extra: dict[str, str] = field(default_factory=dict)


@dataclass
class ChaosEnv:
    settings: Settings
    ports: Ports = field(default_factory=Ports)
    knobs: Knobs = field(default_factory=Knobs)
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    workers: list[Proc] = field(default_factory=list)
    gateways: list[Proc] = field(default_factory=list)
    others: list[Proc] = field(default_factory=list)
    #: the store processor (the conversation writer), for the scenarios whose load holds conversations
    writer: Proc | None = None
    api_key: str = ""

    @property
    def namespace(self) -> str:
        return f"chaos{self.run_id}"

    @property
    def org_id(self) -> str:
        return f"org-chaos-{self.run_id}"

    @property
    def run_dir(self) -> Path:
        return RUN_ROOT / self.run_id

    @property
    def faults_dir(self) -> Path:
        return self.run_dir / "faults"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.ports.gateway(0)}/v1"

    @property
    def base_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{self.ports.gateway(i)}/v1" for i in range(len(self.gateways))]

    def kafka(self) -> object:
        return self.settings.kafka.model_copy(update={"namespace": self.namespace})

    def redis_settings(self) -> RedisSettings:
        return self.settings.redis.model_copy(update={"url": f"redis://127.0.0.1:{self.ports.redis}/0",
                                                      "key_prefix": f"kns-chaos-{self.run_id}:"})

    def env(self) -> dict[str, str]:
        k = self.knobs
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "KNS_KAFKA__NAMESPACE": self.namespace,
               "KNS_REDIS__URL": f"redis://127.0.0.1:{self.ports.redis}/0",
               "KNS_REDIS__KEY_PREFIX": f"kns-chaos-{self.run_id}:", "KNS_SAFETY__PREFILTER": "false",
               "KNS_ENGINE__KIND": k.engine, "KNS_ENGINE__SYNTHETIC_TOKENS_PER_S": str(k.tokens_per_s),
               "KNS_ENGINE__SYNTHETIC_MAX_SEQS": str(k.max_seqs),
               "KNS_GATEWAY__QUEUE_DEADLINE_S": str(k.queue_deadline_s),
               "KNS_GATEWAY__FIRST_TOKEN_GRACE_S": str(k.first_token_grace_s),
               "KNS_KAFKA__SESSION_TIMEOUT_MS": str(k.session_timeout_ms),
               "KNS_WORKER__LIVENESS_TTL_S": str(k.liveness_ttl_s),
               "KNS_FAULTS__DIR": str(self.faults_dir),
               "KNS_PROCESSORS__BILLING_PORT": str(self.ports.billing),
               "KNS_PROCESSORS__STORE_PORT": str(self.ports.store)}
        if k.engine == "vllm":
            env["KNS_ENGINE__MAX_NUM_SEQS"] = str(k.max_seqs)
        return {**env, **k.extra}

    # --- lifecycle ------------------------------------------------------------------------------------

    async def start(self, *, workers: int = 2, gateways: int = 1, writer: bool = False) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        await ensure_topics(self.kafka(), TOPICS.all())  # type: ignore[arg-type]
        await asyncio.to_thread(apply_schema, self.settings.cassandra)  # idempotent: the current schema
        self.api_key = await self._api_key()
        redis = Proc(f"chaos-{self.run_id}-redis", [
            shutil.which("redis-server") or "redis-server", "--port", str(self.ports.redis), "--bind", "127.0.0.1",
            "--save", "", "--appendonly", "no", "--dir", str(self.run_dir),
            "--maxmemory", REDIS_MAXMEMORY, "--maxmemory-policy", REDIS_MAXMEMORY_POLICY], dict(os.environ), "")
        billing = Proc(f"chaos-{self.run_id}-billing", [sys.executable, "-m", "ops.cli", "processor", "billing"],
                       self.env(), f"http://127.0.0.1:{self.ports.billing}/health")
        self.others = [redis, billing]
        if writer:
            self.writer = Proc(f"chaos-{self.run_id}-store", [sys.executable, "-m", "ops.cli", "processor", "store"],
                               self.env(), f"http://127.0.0.1:{self.ports.store}/health")
            self.others.append(self.writer)
        redis.start()
        await self.wait_redis()
        billing.start()
        if self.writer is not None:
            self.writer.start()
        for _ in range(workers):
            self.add_worker()
        for i in range(gateways):
            self.gateways.append(self._app(f"gateway-{i}", "gateway", self.ports.gateway(i), {
                "KNS_GATEWAY__PORT": str(self.ports.gateway(i)),
                "KNS_GATEWAY__INSTANCE_ID": f"chaos-{self.run_id}-gateway-{i}"}))
        for proc in self.gateways:
            proc.start()
        await asyncio.gather(*(p.wait(300) for p in [*self.others[1:], *self.workers, *self.gateways]))

    def _app(self, name: str, command: str, port: int, extra: dict[str, str]) -> Proc:
        health = f"http://127.0.0.1:{port}/health"
        return Proc(f"chaos-{self.run_id}-{name}", [sys.executable, "-m", "ops.cli", command],
                    {**self.env(), **extra}, health)

    def add_worker(self) -> Proc:
        i = len(self.workers)
        proc = self._app(f"worker-{i}", "worker", self.ports.worker(i), {
            "KNS_WORKER__ADMIN_PORT": str(self.ports.worker(i)),
            "KNS_WORKER__INSTANCE_ID": f"chaos-{self.run_id}-worker-{i}"})
        self.workers.append(proc)
        proc.start()
        return proc

    async def wait_redis(self) -> None:
        from redis.asyncio import Redis
        from redis.exceptions import RedisError

        for _ in range(100):
            client = Redis(port=self.ports.redis, socket_timeout=1)
            try:
                if await client.ping():
                    return
            except (RedisError, OSError):
                await asyncio.sleep(0.1)
            finally:
                await client.aclose()
        raise RuntimeError("the chaos Redis did not start")

    async def _api_key(self) -> str:
        async with open_admin(self.settings.model_copy(update={"kafka": self.kafka()})) as admin:
            return (await admin.issue_key(self.org_id, "enterprise", KeyCreate(name="chaos"), limits=UNLIMITED)).secret

    async def stop(self, *, delete_topics: bool = True) -> None:
        for proc in [*self.gateways, *self.workers, *reversed(self.others)]:
            proc.stop()
        if delete_topics:
            admin = make_admin(self.kafka())  # type: ignore[arg-type]
            await admin.start()
            try:
                with contextlib.suppress(Exception):
                    await admin.delete_topics([self.kafka().topic(t.name) for t in TOPICS.all()])  # type: ignore[attr-defined]
            finally:
                await admin.close()

    # --- faults ---------------------------------------------------------------------------------------

    #: the module each supervised service runs (``kns worker`` execs a supervisor whose child runs it)
    SERVICE_MODULES = ("inference_workers.main", "producers.gateway.main", "stream_processors.runner")

    @classmethod
    def service_pid(cls, proc: Proc) -> int:
        """The service process itself: the supervisor's child running the service's module (not a leftover the
        supervisor adopted from a crashed predecessor)."""
        supervisor = proc.pid
        if supervisor is None:
            raise RuntimeError(f"{proc.name} is not running")
        for child in Path(f"/proc/{supervisor}/task/{supervisor}/children").read_text().split():
            with contextlib.suppress(OSError):
                raw = Path(f"/proc/{child}/cmdline").read_bytes()
                # A Faust worker retitles itself (setproctitle): its command line no longer names its module
                if any(m.encode() in raw.split(b"\0") for m in cls.SERVICE_MODULES) or raw.startswith(FAUST_TITLE):
                    return int(child)
        raise RuntimeError(f"{proc.name} runs no service process right now")

    async def mid_generation(self, proc: Proc, timeout_s: float = 30.0, *,
                             at_least: float = 0.0) -> list[dict[str, object]]:
        """Waits until the worker streams a request it has started and not finished (what a SIGKILL must
        then hand over), with at least ``at_least`` of its tokens out, and returns what it runs; an empty list if
        that never happened within ``timeout_s``."""
        state = proc.health.removesuffix("/health") + "/state"
        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient(timeout=2) as client:
            while time.monotonic() < deadline:
                with contextlib.suppress(httpx.HTTPError, ValueError):
                    jobs = (await client.get(state)).json().get("in_flight", [])
                    # some tokens already out (so the takeover shows in the token log), many still to come
                    if any(max(3, at_least * int(j["max_tokens"])) <= int(j["tokens"]) <= int(j["max_tokens"]) - 5
                           for j in jobs):
                        return list(jobs)
                await asyncio.sleep(0.05)
        return []

    def kill_service(self, proc: Proc) -> int:
        """SIGKILL the service process (its supervisor starts a new one)."""
        pid = self.service_pid(proc)
        os.kill(pid, signal.SIGKILL)
        return pid

    def arm(self, point: str, action: str) -> None:
        self.faults_dir.mkdir(parents=True, exist_ok=True)
        (self.faults_dir / point).write_text(action)

    async def restart_redis(self) -> None:
        redis = self.others[0]
        redis.stop()
        redis.start()
        await self.wait_redis()

    def stack(self) -> StackManager:
        return StackManager(self.settings)
