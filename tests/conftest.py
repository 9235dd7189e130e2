"""Session fixtures: one namespace of topics, one worker (the real vLLM engine), one gateway.

The test command (``./dev test``) starts Kafka, Cassandra and Redis before pytest; a missing service fails
the run, it is never skipped. Each session gets its own topic namespace and Redis key prefix, so it neither
sees nor disturbs a dev stack running on the same broker.

Lanes: every test is marked by its directory (``unit``, ``contract``, ``integration``, ``e2e``, ``resilience``,
see ``pytest_collection_modifyitems``); ``pytest -m unit`` (``./dev test --fast``) is the fast lane, everything
that needs no service and no vLLM. A full run goes lane by lane, fastest first.
"""

from __future__ import annotations

import asyncio
import os
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio

from ops.stack.provision import apply_schema, seed_prices
from producers.tenancy.admin import UNLIMITED, KeyCreate, Limits, open_admin
from runtime.cassandra_client import connect
from runtime.kafka_clients import ensure_topics, make_admin
from runtime.settings import Settings, load_settings
from runtime.tenancy import ApiKey
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

TESTS = Path(__file__).parent
#: lane → its place in a full run. The fast lane goes first: the session's stack (worker, gateway, processors) stays
#: up from the first test that needs it to the end of the run, and the timing-sensitive unit tests must not share
#: the two cores with it.
LANES = {"unit": 0, "contract": 0, "vllm": 0, "integration": 1, "e2e": 2, "resilience": 3}
#: seconds a test of the lane may take unless it says otherwise (the others: ``timeout`` in pyproject.toml). A chaos
#: scenario starts a stack of its own, runs its load and its fault, then waits up to 90 s for billing and 60 s for
#: the conversation turns in its audit: a minute or two.
LANE_TIMEOUTS = {"resilience": 600}
#: the fixture every test that needs Kafka, Cassandra or Redis uses (the session's services all depend on it)
SERVICES = "stack"


def _needs_services(item: pytest.Item) -> bool:
    return SERVICES in getattr(item, "fixturenames", ())  # a test function's fixtures, with those they use


def _lane(item: pytest.Item) -> str:
    """The lane of the test's directory, except that a test in tests/unit or tests/contract that needs a service is
    an integration test, and one that imports vLLM (its author marks it ``vllm``) leaves the fast lane."""
    try:
        directory = item.path.relative_to(TESTS).parts[0]
    except ValueError:  # a test file outside tests/
        return ""
    if directory in ("unit", "contract"):
        if _needs_services(item):
            return "integration"
        if item.get_closest_marker("vllm") is not None:
            return "vllm"
    return directory if directory in LANES else ""


def _mark_lane(item: pytest.Item, lane: str) -> None:
    if lane in ("unit", "contract"):
        item.add_marker(pytest.mark.unit)  # the fast lane: unit and contract tests alike need nothing running
    if lane in ("contract", "integration", "e2e", "resilience"):
        item.add_marker(getattr(pytest.mark, lane))


def _time_the_body_only(item: pytest.Item) -> None:
    """A test outside the fast lane is timed from its first line. The session's services start in the fixtures of
    the first test that needs them (the worker, the four processors and the gateway: 179 s here) and stop in the
    last test's teardown (35 s), whichever tests those are; each has deadlines of its own (a vLLM worker up to
    300 s), which a test's timeout must neither absorb nor cut short. Its own timeout mark still gives the
    seconds."""
    marker = item.get_closest_marker("timeout")
    if marker is not None and "func_only" in marker.kwargs:
        return
    args, kwargs = (marker.args, marker.kwargs) if marker is not None else ((), {})
    item.add_marker(pytest.mark.timeout(*args, **kwargs, func_only=True), append=False)  # the closest, so it counts


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by these marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    lanes = {}
    for item in items:
        lanes[item.nodeid] = lane = _lane(item)
        _mark_lane(item, lane)
        if lane in LANE_TIMEOUTS and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(LANE_TIMEOUTS[lane]), append=False)
        if lane in ("integration", "e2e", "resilience"):
            _time_the_body_only(item)
    items.sort(key=lambda item: LANES.get(lanes[item.nodeid], 0))  # stable: each module keeps its order


def pytest_sessionfinish(session: pytest.Session) -> None:
    """The fast lane's promise, checked at its end: a run of ``unit`` tests only never imported vLLM."""
    ran = getattr(session, "items", [])  # unset when the collection failed
    if ran and all(item.get_closest_marker("unit") for item in ran) and "vllm" in sys.modules:
        writer = session.config.get_terminal_writer()
        writer.line()
        writer.line(
            "error: vLLM was imported by a run of unit tests only (mark the test that needs it `vllm`, or import "
            "vLLM inside it)", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


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
