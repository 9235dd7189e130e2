"""Session fixtures: one namespace of topics, one worker (the real vLLM engine), one gateway.

The test command (``./dev test``) starts Kafka, Cassandra and Redis before pytest; a missing service fails
the run, it is never skipped. Each session gets its own topic namespace and Redis key prefix, so it neither
sees nor disturbs a dev stack running on the same broker.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
import pytest_asyncio

from ops.stack.provision import apply_schema, seed_prices
from producers.tenancy.admin import UNLIMITED, KeyCreate, Limits, open_admin
from producers.tenancy.view import ApiKey
from runtime.cassandra_client import connect
from runtime.kafka_clients import ensure_topics, make_admin
from runtime.settings import Settings, load_settings
from schemas.topics import TOPICS
from tests.helpers import ServiceProcess

SESSION = uuid.uuid4().hex[:8]
# Two test sessions on one machine (a developer's and a helper's) need their own ports: KNS_TEST_PORT_BASE.
PORT_BASE = int(os.environ.get("KNS_TEST_PORT_BASE", "18000"))
GATEWAY_PORT = PORT_BASE
WORKER_ADMIN_PORT = PORT_BASE + 100
PROCESSOR_PORTS = {"safety": PORT_BASE + 201, "billing": PORT_BASE + 202, "abuse": PORT_BASE + 203,
                   "store": PORT_BASE + 204}

# Set before anything builds settings: this process and every service it starts share them.
TEST_ENV = {
    "KNS_KAFKA__NAMESPACE": f"t{SESSION}",
    "KNS_CASSANDRA__KEYSPACE": "kns_test",
    "KNS_REDIS__KEY_PREFIX": f"kns-test-{SESSION}:",
    "KNS_GATEWAY__PORT": str(GATEWAY_PORT),
    "KNS_GATEWAY__INSTANCE_ID": f"test-gateway-a-{SESSION}",
    "KNS_WORKER__ADMIN_PORT": str(WORKER_ADMIN_PORT),
    "KNS_WORKER__INSTANCE_ID": f"test-worker-{SESSION}",
    "KNS_WORKER__DRAIN_TIMEOUT_S": "2",
    "KNS_ENGINE__MAX_NUM_SEQS": "16",
    "KNS_GATEWAY__STREAM_IDLE_TIMEOUT_S": "90",
    **{f"KNS_PROCESSORS__{name.upper()}_PORT": str(port) for name, port in PROCESSOR_PORTS.items()},
}
os.environ.update(TEST_ENV)


@dataclass(frozen=True)
class Caller:
    secret: str
    key: ApiKey


@pytest.fixture(scope="session")
def settings() -> Settings:
    return load_settings()


@pytest.fixture(scope="session")
def service_env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1"}


def _fail_without_stack(settings: Settings) -> None:
    from ops.stack.services import CassandraService, KafkaService, RedisService

    async def check() -> list[str]:
        services = [KafkaService(settings), CassandraService(settings), RedisService(settings)]
        states = await asyncio.gather(*(s.healthy() for s in services))
        return [s.name for s, ok in zip(services, states, strict=True) if not ok]

    missing = asyncio.run(check())
    if missing:
        pytest.fail(f"{', '.join(missing)} not reachable: start them with `./dev test` (or `kns stack up "
                    "--infra-only`); the suite needs the real services", pytrace=False)


async def _seed_prices(settings: Settings) -> None:
    cluster, session = await asyncio.to_thread(connect, settings.cassandra)
    try:
        await seed_prices(session, settings.cassandra.keyspace)
    finally:
        await asyncio.to_thread(cluster.shutdown)


@pytest.fixture(scope="session")
def stack(settings: Settings) -> Iterator[Settings]:
    """Kafka, Cassandra and Redis are up; this session's topics and the test keyspace exist."""
    _fail_without_stack(settings)
    asyncio.run(ensure_topics(settings.kafka, TOPICS.all()))
    apply_schema(settings.cassandra)
    asyncio.run(_seed_prices(settings))
    yield settings

    async def drop_topics() -> None:
        admin = make_admin(settings.kafka)
        await admin.start()
        try:
            await admin.delete_topics([settings.kafka.topic(t.name) for t in TOPICS.all()])
        finally:
            await admin.close()

    asyncio.run(drop_topics())


@pytest.fixture(scope="session")
def make_caller(stack: Settings):  # type: ignore[no-untyped-def]
    """Issues API keys through the key registry: ``make_caller(org, tier, **key_options)``. The org's limits are
    out of reach unless a test passes its own (``limits=None``: its tier's)."""

    def create(org: str = f"org-test-{SESSION}", tier: str = "plus", limits: Limits | None = UNLIMITED,
               **options: object) -> Caller:
        async def go() -> Caller:
            async with open_admin(stack) as admin:
                issued = await admin.issue_key(org, tier, KeyCreate.model_validate(options), limits=limits)
                return Caller(issued.secret, ApiKey(issued.record, admin.org(org)))

        # Sync and async tests both call this: run the coroutine on a thread with its own event loop.
        with ThreadPoolExecutor(1) as pool:
            return pool.submit(asyncio.run, go()).result()

    return create


@pytest.fixture(scope="session")
def caller(make_caller) -> Caller:  # type: ignore[no-untyped-def]
    return make_caller()


def processor(name: str, env: dict[str, str]) -> ServiceProcess:
    return ServiceProcess(f"processor-{name}", "processor", env,
                          f"http://127.0.0.1:{PROCESSOR_PORTS[name]}/health", args=[name])


@pytest.fixture(scope="session")
def processors(stack: Settings, service_env: dict[str, str]) -> Iterator[dict[str, ServiceProcess]]:
    """The four Faust processors (safety, billing, abuse, store), healthy before any gateway produces."""
    procs = {name: processor(name, service_env) for name in PROCESSOR_PORTS}
    for proc in procs.values():
        proc.start()
    try:
        for proc in procs.values():
            proc.wait_healthy(180)
        yield procs
    finally:
        for proc in procs.values():
            proc.stop()


@pytest.fixture(scope="session")
def worker(stack: Settings, service_env: dict[str, str]) -> Iterator[ServiceProcess]:
    proc = ServiceProcess("worker", "worker", service_env, f"http://127.0.0.1:{WORKER_ADMIN_PORT}/health")
    proc.start()
    try:
        proc.wait_healthy(300)
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="session")
def gateway(stack: Settings, worker: ServiceProcess, processors: dict[str, ServiceProcess],
            service_env: dict[str, str]) -> Iterator[ServiceProcess]:
    proc = ServiceProcess("gateway-a", "gateway", service_env, f"http://127.0.0.1:{GATEWAY_PORT}/health")
    proc.start()
    try:
        proc.wait_healthy(120)
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="session")
def base_url(gateway: ServiceProcess) -> str:
    return f"http://127.0.0.1:{GATEWAY_PORT}/v1"


@pytest_asyncio.fixture(loop_scope="session")
async def aclient(base_url: str, caller: Caller) -> AsyncIterator[object]:
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key=caller.secret, max_retries=0, timeout=120)
    yield client
    await client.close()


@pytest.fixture()
def client(base_url: str, caller: Caller):  # type: ignore[no-untyped-def]
    import openai

    with openai.OpenAI(base_url=base_url, api_key=caller.secret, max_retries=0, timeout=120) as c:
        yield c
