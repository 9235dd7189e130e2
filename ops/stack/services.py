"""The services of the local stack: how each is prepared, launched and health-checked.

Kafka and Cassandra run straight from Maven-materialised jars (see ``ops/stack/jars.py``), Redis from the
Debian package, the gateway and the worker from this repository's virtual environment.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import socket
import subprocess
import sys
from abc import ABC, abstractmethod
from pathlib import Path
from string import Template
from urllib.parse import urlparse

import httpx

from runtime.settings import REPO_ROOT, Settings

INFRA = REPO_ROOT / "infra" / "local"


def port_open(port: int, host: str = "127.0.0.1", timeout: float = 0.3) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        return sock.connect_ex((host, port)) == 0


def _host_port(hostport: str) -> int:
    return int(hostport.split(",")[0].rsplit(":", 1)[1])


def render(template: Path, target: Path, **values: object) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(Template(template.read_text()).substitute({k: str(v) for k, v in values.items()}))
    return target


def java_binary() -> str:
    java = shutil.which("java")
    if java is None:
        raise StackError(
            "Java is not installed: Kafka and Cassandra need a JDK 17 (apt-get install openjdk-17-jdk-headless)"
        )
    out = subprocess.run([java, "-version"], capture_output=True, text=True).stderr
    match = re.search(r'version "(\d+)', out)
    if match is None or int(match.group(1)) < 17:
        first = out.splitlines()[0] if out else "no version"
        raise StackError(f"Kafka 4.3 and Cassandra 5.0 need Java 17 or newer; found: {first}")
    return java


class StackError(Exception):
    """A clear, user-facing reason why the stack cannot start."""


class Service(ABC):
    """One process the stack manager owns."""

    name: str
    #: infrastructure services start first and hold data; app services are this repository's processes
    infra: bool = True

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.stack = settings.stack

    @property
    def log_file(self) -> Path:
        return self.stack.logs_dir / f"{self.name}.log"

    @property
    def data_dir(self) -> Path:
        return self.stack.data_dir / self.name

    @abstractmethod
    def ports(self) -> list[int]: ...

    @abstractmethod
    def command(self) -> list[str]: ...

    def prepare(self) -> None:
        """Write configs, create folders, format storage: everything before the first launch."""
        self.data_dir.mkdir(parents=True, exist_ok=True)

    def env(self) -> dict[str, str]:
        return dict(os.environ)

    def nice(self) -> int:
        """The nice level it runs at beside an engine (an app service sets its own, ``runtime/cpu_priority.py``)."""
        return self.settings.cpu.yield_nice

    @abstractmethod
    async def healthy(self) -> bool: ...

    def details(self) -> str:
        return ""


class KafkaService(Service):
    name = "kafka"

    @property
    def port(self) -> int:
        return _host_port(self.settings.kafka.bootstrap_servers)

    def ports(self) -> list[int]:
        return [self.port, self.stack.kafka_controller_port]

    def nice(self) -> int:
        return self.settings.cpu.kafka_nice

    @property
    def conf_dir(self) -> Path:
        return self.stack.root / "conf" / "kafka"

    def prepare(self) -> None:
        super().prepare()
        java = java_binary()
        props = render(
            INFRA / "kafka" / "server.properties",
            self.conf_dir / "server.properties",
            port=self.port,
            controller_port=self.stack.kafka_controller_port,
            log_dirs=self.data_dir / "kraft",
        )
        if (self.data_dir / "kraft" / "meta.properties").exists():
            return
        # Format KRaft storage once: a new cluster id, then the storage tool.
        classpath = f"{self.stack.lib_dir / 'kafka'}/*"
        tools_log = f"-Dlog4j2.configurationFile={INFRA / 'kafka' / 'tools-log4j2.xml'}"
        cluster_id = subprocess.run(
            [java, tools_log, "-cp", classpath, "kafka.tools.StorageTool", "random-uuid"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()
        result = subprocess.run(
            [java, tools_log, "-cp", classpath, "kafka.tools.StorageTool", "format",
             "-t", cluster_id, "-c", str(props), "--ignore-formatted"],
            capture_output=True, text=True,
        )
        if result.returncode != 0:
            raise StackError(f"formatting Kafka storage failed:\n{result.stdout}{result.stderr}")

    def command(self) -> list[str]:
        lib = self.stack.lib_dir
        jmx_agent = next((lib / "jmx").glob("jmx_prometheus_javaagent-*.jar"))
        return [
            java_binary(), f"-Xms{self.stack.kafka_heap}", f"-Xmx{self.stack.kafka_heap}",
            "-server", "-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20", "-XX:+ExplicitGCInvokesConcurrent",
            "-Djava.awt.headless=true",
            f"-javaagent:{jmx_agent}={self.stack.kafka_jmx_exporter_port}:{INFRA / 'jmx' / 'kafka.yml'}",
            f"-Dlog4j2.configurationFile={INFRA / 'kafka' / 'log4j2.xml'}",
            f"-Dkafka.logs.dir={self.stack.logs_dir / 'kafka'}",
            "-cp", f"{lib / 'kafka'}/*", "kafka.Kafka", str(self.conf_dir / "server.properties"),
        ]

    async def healthy(self) -> bool:
        if not port_open(self.port):
            return False
        from aiokafka.admin import AIOKafkaAdminClient
        from aiokafka.errors import KafkaError

        admin = AIOKafkaAdminClient(bootstrap_servers=self.settings.kafka.bootstrap_servers,
                                    request_timeout_ms=3000)
        try:
            await asyncio.wait_for(admin.start(), 5)
            await asyncio.wait_for(admin.list_topics(), 5)
            return True
        except (KafkaError, OSError, TimeoutError):
            return False
        finally:
            await admin.close()

    def details(self) -> str:
        return f"bootstrap {self.settings.kafka.bootstrap_servers}, metrics :{self.stack.kafka_jmx_exporter_port}"


class CassandraService(Service):
    name = "cassandra"
    _OPENS = [
        "--add-exports", "java.base/jdk.internal.misc=ALL-UNNAMED",
        "--add-exports", "java.management.rmi/com.sun.jmx.remote.internal.rmi=ALL-UNNAMED",
        "--add-exports", "java.rmi/sun.rmi.registry=ALL-UNNAMED",
        "--add-exports", "java.rmi/sun.rmi.server=ALL-UNNAMED",
        "--add-exports", "java.sql/java.sql=ALL-UNNAMED",
        "--add-exports", "java.base/java.lang.ref=ALL-UNNAMED",
        "--add-exports", "jdk.unsupported/sun.misc=ALL-UNNAMED",
        "--add-exports", "jdk.compiler/com.sun.tools.javac.file=ALL-UNNAMED",
        "--add-exports", "jdk.attach/sun.tools.attach=ALL-UNNAMED",
        "--add-opens", "java.base/java.lang.module=ALL-UNNAMED",
        "--add-opens", "java.base/jdk.internal.loader=ALL-UNNAMED",
        "--add-opens", "java.base/jdk.internal.ref=ALL-UNNAMED",
        "--add-opens", "java.base/jdk.internal.reflect=ALL-UNNAMED",
        "--add-opens", "java.base/jdk.internal.math=ALL-UNNAMED",
        "--add-opens", "java.base/jdk.internal.module=ALL-UNNAMED",
        "--add-opens", "java.base/jdk.internal.util.jar=ALL-UNNAMED",
        "--add-opens", "jdk.management/com.sun.management.internal=ALL-UNNAMED",
        "--add-opens", "java.base/sun.nio.ch=ALL-UNNAMED",
        "--add-opens", "java.base/java.io=ALL-UNNAMED",
        "--add-opens", "java.base/java.lang.reflect=ALL-UNNAMED",
        "--add-opens", "jdk.compiler/com.sun.tools.javac=ALL-UNNAMED",
        "--add-opens", "java.base/java.lang=ALL-UNNAMED",
        "--add-opens", "java.base/java.util=ALL-UNNAMED",
    ]

    @property
    def port(self) -> int:
        return self.settings.cassandra.port

    def ports(self) -> list[int]:
        return [self.port, self.stack.cassandra_storage_port]

    @property
    def conf_dir(self) -> Path:
        return self.stack.root / "conf" / "cassandra"

    def prepare(self) -> None:
        super().prepare()
        java_binary()
        render(INFRA / "cassandra" / "cassandra.yaml", self.conf_dir / "cassandra.yaml",
               storage_port=self.stack.cassandra_storage_port, native_port=self.port)
        shutil.copy(INFRA / "cassandra" / "logback.xml", self.conf_dir / "logback.xml")

    def command(self) -> list[str]:
        lib = self.stack.lib_dir
        heap = self.stack.cassandra_heap
        jmx_agent = next((lib / "jmx").glob("jmx_prometheus_javaagent-*.jar"))
        return [
            java_binary(), f"-Xms{heap}", f"-Xmx{heap}", "-Xss256k",
            "-XX:+UseG1GC", "-XX:+ParallelRefProcEnabled", "-XX:MaxTenuringThreshold=1",
            "-XX:+ExitOnOutOfMemoryError", "-XX:+PerfDisableSharedMem",
            "-Djava.net.preferIPv4Stack=true", "-Djdk.attach.allowAttachSelf=true",
            *self._OPENS,
            "-Dio.netty.tryReflectionSetAccessible=true",
            f"-javaagent:{jmx_agent}={self.stack.cassandra_jmx_exporter_port}:{INFRA / 'jmx' / 'cassandra.yml'}",
            "-Dcassandra-foreground=yes",
            f"-Dcassandra.config=file://{self.conf_dir / 'cassandra.yaml'}",
            f"-Dcassandra.storagedir={self.data_dir}",
            f"-Dcassandra.logdir={self.stack.logs_dir / 'cassandra'}",
            f"-Dlogback.configurationFile=file://{self.conf_dir / 'logback.xml'}",
            # A fresh single node need not wait for a ring to settle: ~37 s start becomes ~7 s.
            "-Dcassandra.ring_delay_ms=100", "-Dcassandra.skip_wait_for_gossip_to_settle=0",
            "-Dcassandra.superuser_setup_delay_ms=0", "-Dcassandra.shutdown_announce_in_ms=0",
            "-cp", f"{lib / 'cassandra'}/*:{self.conf_dir}", "org.apache.cassandra.service.CassandraDaemon",
        ]

    async def healthy(self) -> bool:
        if not port_open(self.port):
            return False
        from cassandra import DriverException
        from cassandra.cluster import NoHostAvailable

        from runtime.cassandra_client import connect

        def probe() -> bool:
            cluster, session = connect(self.settings.cassandra.model_copy(update={"connect_timeout_s": 3}))
            try:
                session.execute("SELECT release_version FROM system.local")
                return True
            finally:
                cluster.shutdown()

        try:
            return await asyncio.to_thread(probe)
        except (DriverException, NoHostAvailable, OSError):
            return False

    def details(self) -> str:
        return f"cql 127.0.0.1:{self.port}, metrics :{self.stack.cassandra_jmx_exporter_port}"


#: Redis's memory bound, and what happens at it: nothing is evicted, writes are refused (``OOM`` errors). Every key
#: Redis holds is live state (rate-limit windows and in-flight leases, budget holds, suspensions, stream records,
#: partition and worker leases, read-your-writes notes): an evicting policy would drop them silently, and a dropped
#: window admits past the limit while a dropped stream record makes a live stream unresumable. Refused writes are
#: loud instead: the gateway answers them as Redis down (503, or a tier's local limiter), the processors retry.
#: The bound is the dev stack's; size it to the fleet (a chat stream record is a few hundred bytes, a Responses
#: one carries its response object; each lives ``resume_ttl_s``).
REDIS_MAXMEMORY = "512mb"
REDIS_MAXMEMORY_POLICY = "noeviction"


class RedisService(Service):
    name = "redis"

    @property
    def port(self) -> int:
        return urlparse(self.settings.redis.url).port or 6379

    def ports(self) -> list[int]:
        return [self.port]

    def command(self) -> list[str]:
        binary = shutil.which("redis-server")
        if binary is None:
            raise StackError("redis-server is not installed (./dev setup installs it: apt-get install redis-server)")
        return [
            binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.data_dir),
            "--appendonly", "yes", "--save", "", "--daemonize", "no", "--logfile", "",
            "--maxmemory", REDIS_MAXMEMORY, "--maxmemory-policy", REDIS_MAXMEMORY_POLICY,
        ]

    async def healthy(self) -> bool:
        if not port_open(self.port):
            return False
        from redis.asyncio import Redis
        from redis.exceptions import RedisError

        client = Redis(host="127.0.0.1", port=self.port, socket_timeout=2)
        try:
            return bool(await client.ping())
        except (RedisError, OSError):
            return False
        finally:
            await client.aclose()

    def details(self) -> str:
        return self.settings.redis.url


class _AppService(Service):
    """A process of this repository, run as ``python -m ops.cli <subcommand>``."""

    infra = False
    subcommand: str
    #: start-up waves: processors (1) before the worker and the gateway (2), which produce and consume for them
    wave: int = 2

    def command(self) -> list[str]:
        return [sys.executable, "-m", "ops.cli", self.subcommand]

    def env(self) -> dict[str, str]:
        env = super().env()
        env.setdefault("PYTHONUNBUFFERED", "1")
        return env

    @property
    def health_url(self) -> str:
        raise NotImplementedError

    async def healthy(self) -> bool:
        try:
            async with httpx.AsyncClient(timeout=2) as client:
                return (await client.get(self.health_url)).status_code == 200
        except httpx.HTTPError:
            return False


class ProcessorService(_AppService):
    """One Faust stream processor (safety, billing, abuse or store)."""

    wave = 1
    subcommand = "processor"

    def __init__(self, settings: Settings, processor: str) -> None:
        super().__init__(settings)
        self.processor = processor
        self.name = f"processor-{processor}"

    def command(self) -> list[str]:
        return [*super().command(), self.processor]

    def ports(self) -> list[int]:
        return [self.settings.processors.port(self.processor)]

    @property
    def health_url(self) -> str:
        return f"http://{self.settings.processors.host}:{self.ports()[0]}/health"

    def details(self) -> str:
        return f"metrics http://{self.settings.processors.host}:{self.ports()[0]}/metrics"


class WorkerService(_AppService):
    name = "worker"
    subcommand = "worker"

    def ports(self) -> list[int]:
        return [self.settings.worker.admin_port]

    @property
    def health_url(self) -> str:
        return f"http://{self.settings.worker.admin_host}:{self.settings.worker.admin_port}/health"

    def details(self) -> str:
        return f"metrics http://{self.settings.worker.admin_host}:{self.settings.worker.admin_port}/metrics"


class GatewayService(_AppService):
    name = "gateway"
    subcommand = "gateway"

    def ports(self) -> list[int]:
        return [self.settings.gateway.port]

    @property
    def health_url(self) -> str:
        return f"http://{self.settings.gateway.host}:{self.settings.gateway.port}/health"

    def details(self) -> str:
        return f"http://{self.settings.gateway.host}:{self.settings.gateway.port}/v1"


def all_services(settings: Settings) -> list[Service]:
    return [
        KafkaService(settings),
        CassandraService(settings),
        RedisService(settings),
        ProcessorService(settings, "safety"),
        ProcessorService(settings, "billing"),
        ProcessorService(settings, "abuse"),
        ProcessorService(settings, "store"),
        WorkerService(settings),
        GatewayService(settings),
    ]
