from __future__ import annotations

import re
import uuid
from collections.abc import Iterator

import httpx
import pytest

from runtime.settings import Settings
from schemas.codec import codec_for
from schemas.events import TokenEvent, UsageEvent
from schemas.topics import TOPICS
from tests.conftest import GATEWAY_PORT, SESSION
from tests.helpers import ServiceProcess, read_topic

MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
#: the session's gateway, then two more (``three_gateways``; +1 and +2 are other tests' own gateways)
GATEWAY_PORTS = (GATEWAY_PORT, GATEWAY_PORT + 4, GATEWAY_PORT + 5)


def gateway_process(port: int, service_env: dict[str, str], instance: str | None = None, **env: str
                    ) -> ServiceProcess:
    """Another gateway process on the session's stack (``env``: its own settings)."""
    return ServiceProcess(f"gateway-{port}", "gateway",
                          {**service_env, "KNS_GATEWAY__PORT": str(port),
                           "KNS_GATEWAY__INSTANCE_ID": instance or f"test-gateway-{port}-{SESSION}", **env},
                          f"http://127.0.0.1:{port}/health")


@pytest.fixture(scope="module")
def three_gateways(gateway: ServiceProcess, service_env: dict[str, str]) -> Iterator[tuple[int, ...]]:
    """Three gateway processes on one stack: the session's and two more, for the module that asks (stopped after
    it, so that nothing else runs beside them)."""
    procs = [gateway_process(port, service_env) for port in GATEWAY_PORTS[1:]]
    for proc in procs:
        proc.start()
    try:
        for proc in procs:
            proc.wait_healthy(120)
        yield GATEWAY_PORTS
    finally:
        for proc in procs:
            proc.stop()


@pytest.fixture()
def offender(base_url: str, make_caller):  # type: ignore[no-untyped-def]
    """An openai client on a key of its own org, for a test that sends what the safety filters refuse: every
    refusal counts towards the abuse detector's suspension of the key that sent it (6 in 10 minutes), and the
    session's key serves every other test."""
    import openai

    caller = make_caller(org=f"org-offender-{uuid.uuid4().hex[:8]}")
    with openai.OpenAI(base_url=base_url, api_key=caller.secret, max_retries=0, timeout=120) as client:
        yield client


async def token_records(settings: Settings, request_id: str) -> list[tuple[int, TokenEvent]]:
    """(offset, event) of the request's token events as its reply partition holds them, in log order (a record
    carries the deltas of every request of one engine step: ``schemas/token_batch.py``)."""
    rows = await read_topic(settings.kafka, settings.kafka.topic(TOPICS.tokens.name), codec_for(TokenEvent),
                            isolation="read_uncommitted")
    ours = [(off, e) for _, off, record, _ in rows for e in record.split()  # type: ignore[attr-defined]
            if e.request_id == request_id]
    return sorted(ours, key=lambda pair: pair[0])  # stable: a record's own deltas stay in their order


async def token_events(settings: Settings, request_id: str) -> list[TokenEvent]:
    """The request's token events, in seq order."""
    records = await token_records(settings, request_id)
    return sorted((e for _, e in records), key=lambda e: (e.attempt, e.seq))


async def usage_events(settings: Settings, request_id: str) -> list[UsageEvent]:
    rows = await read_topic(settings.kafka, settings.kafka.topic(TOPICS.usage.name), codec_for(UsageEvent))
    return [e for _, _, e, _ in rows if e.request_id == request_id]  # type: ignore[misc]


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one Prometheus sample (0 when absent)."""
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        match = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$", line)
        if not match or match.group(1) != name:
            continue
        got = ",".join(sorted((match.group(2) or "{}")[1:-1].split(","))) if match.group(2) else ""
        if got == wanted:
            return float(match.group(3))
    return 0.0


def scrape(url: str) -> str:
    return httpx.get(url, timeout=5).text


async def records_of(settings: Settings, spec: object, codec_model: type, predicate=None):  # type: ignore[no-untyped-def]
    """Decoded events of one of our topics (read_committed), optionally filtered."""
    rows = await read_topic(settings.kafka, settings.kafka.topic(spec.name), codec_for(codec_model))  # type: ignore[attr-defined]
    return [e for _, _, e, _ in rows if predicate is None or predicate(e)]


def kns(env: dict[str, str], *args: str, timeout: float = 120):  # type: ignore[no-untyped-def]
    """Run the kns CLI against this test session's namespace."""
    import subprocess
    import sys

    from runtime.settings import REPO_ROOT

    return subprocess.run([sys.executable, "-m", "ops.cli", *args], cwd=REPO_ROOT, env={**env, "COLUMNS": "250"},
                          capture_output=True, text=True, timeout=timeout)
