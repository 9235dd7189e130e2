"""Metrics, trace context across Kafka hops, structured logs with the request id."""

from __future__ import annotations

import httpx
import openai
import orjson
import pytest

from runtime.settings import Settings
from schemas.codec import codec_for
from schemas.events import ChatRequest, TokenEvent
from schemas.topics import TOPICS
from tests.conftest import GATEWAY_PORT, PROCESSOR_PORTS, WORKER_ADMIN_PORT
from tests.e2e.conftest import MODEL, QUESTION, metric, scrape
from tests.helpers import ServiceProcess, read_topic, wait_for

pytestmark = pytest.mark.e2e


async def test_trace_context_and_logs_follow_the_request(client: openai.OpenAI, stack: Settings,
                                                         worker: ServiceProcess, gateway: ServiceProcess) -> None:
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=QUESTION, temperature=0,
                                                          max_tokens=8)
    request_id = raw.parse().id
    trace = raw.headers["traceparent"].split("-")[1]
    kafka = stack.kafka
    requests = await read_topic(kafka, kafka.topic(TOPICS.requests_admitted.name), codec_for(ChatRequest))
    tokens = await read_topic(kafka, kafka.topic(TOPICS.tokens.name), codec_for(TokenEvent),
                              isolation="read_uncommitted")

    def traces(rows) -> set[str]:  # type: ignore[no-untyped-def]
        return {dict(h)["traceparent"].decode().split("-")[1] for _, _, e, h in rows if e.request_id == request_id}

    assert traces(requests) == {trace}
    assert traces(tokens) == {trace}

    def logged(proc: ServiceProcess, message: str) -> bool:
        for line in proc.log_text().splitlines():
            if line.startswith("{") and request_id in line:
                entry = orjson.loads(line)
                if entry["msg"] == message and entry["request_id"] == request_id:
                    return True
        return False

    assert logged(gateway, "request submitted")
    assert await wait_for(lambda: logged(worker, "request finished"))


def test_metrics_are_exported(client: openai.OpenAI) -> None:
    client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=4, stream=False)
    gateway = scrape(f"http://127.0.0.1:{GATEWAY_PORT}/metrics")
    worker = scrape(f"http://127.0.0.1:{WORKER_ADMIN_PORT}/metrics")
    assert metric(gateway, "kns_gateway_ttft_seconds_count") > 0
    assert metric(gateway, "kns_gateway_inter_token_seconds_count") > 0
    assert metric(gateway, "kns_gateway_e2e_seconds_count") > 0
    assert metric(gateway, "kns_gateway_tokens_out_total") > 0
    assert metric(gateway, "kns_kafka_hop_seconds_count", hop="worker_to_relay") > 0
    assert "kns_gateway_requests_in_flight" in gateway
    assert metric(worker, "kns_worker_tokens_out_total") > 0
    assert metric(worker, "kns_kafka_hop_seconds_count", hop="gateway_to_worker") > 0
    assert metric(worker, "kns_worker_finalize_txn_seconds_count") > 0
    assert "kns_worker_requests_in_flight" in worker


def test_every_processor_exports_its_metrics(client: openai.OpenAI, processors: dict[str, ServiceProcess]) -> None:
    client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=4)
    expected = {"safety": "kns_safety_verdicts_total", "billing": "kns_billing_usage_total",
                "abuse": "kns_dead_lettered_total"}
    for name, family in expected.items():
        response = httpx.get(f"http://127.0.0.1:{PROCESSOR_PORTS[name]}/metrics", timeout=5)
        assert response.status_code == 200, name
        assert response.headers["content-type"].startswith("text/plain")
        assert family in response.text, name
    safety = scrape(f"http://127.0.0.1:{PROCESSOR_PORTS['safety']}/metrics")
    assert metric(safety, "kns_safety_classify_seconds_count", stage="pre") > 0
