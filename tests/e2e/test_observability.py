"""Metrics, trace context across Kafka hops, structured logs with the request id."""

from __future__ import annotations

import itertools
import uuid

import httpx
import openai
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from runtime.kafka_clients import make_producer
from runtime.settings import Settings
from schemas.codec import codec_for
from schemas.events import ChatRequest, TokenEvent
from schemas.topics import TOPICS
from tests.conftest import GATEWAY_PORT, PROCESSOR_PORTS, WORKER_ADMIN_PORT
from tests.e2e.conftest import MODEL, QUESTION, scrape, token_events
from tests.helpers import ServiceProcess, read_topic, wait_for


class Raw:
    """The dead-letter topic keeps records as they came."""

    @staticmethod
    def decode(value: bytes) -> bytes:
        return value

pytestmark = pytest.mark.e2e


async def test_trace_context_and_logs_follow_the_request(client: openai.OpenAI, stack: Settings,
                                                         worker: ServiceProcess, gateway: ServiceProcess) -> None:
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=QUESTION, temperature=0,
                                                          max_tokens=8)
    request_id = raw.parse().id
    trace = raw.headers["traceparent"].split("-")[1]
    kafka = stack.kafka
    requests = [row for queue in TOPICS.work_queues()
                for row in await read_topic(kafka, kafka.topic(queue.name), codec_for(ChatRequest))]
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


def total(text: str, sample: str, **labels: str) -> float:
    """The sum of one sample name's values whose labels include ``labels`` (0 when there is none).

    Every process imports the one metrics module, so each one lists every family: only values tell them apart.
    """
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == sample and labels.items() <= s.labels.items())


def moved(before: str, after: str, sample: str, **labels: str) -> float:
    return total(after, sample, **labels) - total(before, sample, **labels)


async def scrape_until(url: str, before: str, sample: str, **labels: str) -> str:
    """Scrape ``url`` until ``sample`` has moved since ``before`` (a process may count after its client is
    answered); the last scrape either way."""
    def after() -> str | None:
        text = scrape(url)
        return text if moved(before, text, sample, **labels) else None

    return await wait_for(after, timeout_s=30) or scrape(url)


async def test_metrics_are_exported(client: openai.OpenAI, stack: Settings) -> None:
    # the gateway's metrics are served on its internal port only (its port + 50)
    gateway_url = f"http://127.0.0.1:{GATEWAY_PORT + 50}/metrics"
    worker_url = f"http://127.0.0.1:{WORKER_ADMIN_PORT}/metrics"
    # Counters add up over the whole session: what counts is what this one request moved.
    gateway_before, worker_before = scrape(gateway_url), scrape(worker_url)
    chunks = list(client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=16,
                                                 stream=True, stream_options={"include_usage": True}))
    request_id, usage = chunks[-1].id, chunks[-1].usage
    (finish,) = {c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason}
    events = await token_events(stack, request_id)
    with_tokens = [e for e in events if e.token_ids]
    content_chunks = [c for c in chunks if c.choices and c.choices[0].delta.content]

    # The gateway closes its books (e2e, outcome) after the last byte is sent: wait for that.
    gateway = await scrape_until(gateway_url, gateway_before, "kns_gateway_e2e_seconds_count")
    assert moved(gateway_before, gateway, "kns_gateway_e2e_seconds_count") == 1
    assert moved(gateway_before, gateway, "kns_gateway_requests_total", outcome=finish, stream="true") == 1
    assert moved(gateway_before, gateway, "kns_gateway_ttft_seconds_count") == 1
    assert moved(gateway_before, gateway, "kns_gateway_prompt_seconds_count") == 1
    assert moved(gateway_before, gateway, "kns_gateway_tokens_out_total") == usage.completion_tokens
    # One gap per delta after the first: at least one per content chunk the client got, at most one per event.
    gaps = moved(gateway_before, gateway, "kns_gateway_inter_token_seconds_count")
    assert len(content_chunks) - 1 <= gaps <= len(with_tokens) - 1, (gaps, len(content_chunks), len(with_tokens))
    assert moved(gateway_before, gateway, "kns_kafka_hop_seconds_count", hop="worker_to_relay") >= len(events)

    # The worker counts a request finished once its transaction is done, which the client does not wait for.
    await scrape_until(worker_url, worker_before, "kns_worker_requests_finished_total", finish_reason=finish)
    worker = await scrape_until(worker_url, worker_before, "kns_worker_finalize_txn_seconds_count")
    assert moved(worker_before, worker, "kns_worker_requests_finished_total", finish_reason=finish) == 1
    assert moved(worker_before, worker, "kns_worker_finalize_txn_seconds_count") >= 1
    assert moved(worker_before, worker, "kns_kafka_hop_seconds_count", hop="gateway_to_worker") >= 1
    assert moved(worker_before, worker, "kns_worker_claim_seconds_count") >= 1
    # Every completion token, the ones riding in the final event included.
    assert moved(worker_before, worker, "kns_worker_tokens_out_total") == usage.completion_tokens

    # In-flight gauges are 0 in every process but the one doing the work: look while a long answer streams.
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Write a very long story about a dragon."}],
        max_tokens=1500, stream=True, extra_body={"ignore_eos": True})
    try:
        started = list(itertools.islice(stream, 2))
        assert len(started) == 2 and started[-1].choices[0].finish_reason is None, started
        assert total(scrape(gateway_url), "kns_gateway_requests_in_flight") == 1
        assert total(scrape(worker_url), "kns_worker_requests_in_flight") == 1
    finally:
        stream.close()
    # The client's connection dropped: the gateway's stream is over, the worker suspends the generation for the
    # resume window (it stays in flight there, suspended), until its client cancels it from any gateway
    assert await wait_for(lambda: total(scrape(gateway_url), "kns_gateway_requests_in_flight") == 0, timeout_s=30)
    assert await wait_for(lambda: total(scrape(worker_url), "kns_worker_suspended_streams") == 1, timeout_s=30)
    async with httpx.AsyncClient(timeout=30) as http:
        cancelled = await http.post(f"{client.base_url}chat/completions/{started[0].id}/cancel",
                                    headers={"Authorization": f"Bearer {client.api_key}"})
    assert cancelled.status_code == 200, cancelled.text
    assert await wait_for(lambda: total(scrape(worker_url), "kns_worker_requests_in_flight") == 0, timeout_s=30)
    assert total(scrape(worker_url), "kns_worker_suspended_streams") == 0


async def test_every_processor_exports_its_metrics(client: openai.OpenAI, stack: Settings,
                                                   processors: dict[str, ServiceProcess]) -> None:
    urls = {name: f"http://127.0.0.1:{port}/metrics" for name, port in PROCESSOR_PORTS.items()}
    async with httpx.AsyncClient(timeout=5) as http:
        for name, url in urls.items():
            response = await http.get(url)
            assert response.status_code == 200, name
            assert response.headers["content-type"].startswith("text/plain"), name
    before = {name: scrape(url) for name, url in urls.items()}
    # A text the pre-filter has not judged before: it remembers the windows it classified (screening.py), and a
    # remembered verdict takes no classification.
    question = [{"role": "user", "content": f"What is the capital of France? (asked by {uuid.uuid4().hex[:8]})"}]
    answer = client.chat.completions.create(model=MODEL, messages=question, temperature=0, max_tokens=4)
    # A normal request raises no abuse alert; a record nobody can read is something only the abuse processor
    # counts as its own (the safety pre-filter reads the same topic and counts it under its own name).
    submitted = TOPICS.requests_submitted
    garbage = b"\x00metrics: not avro " + answer.id.encode()
    producer = make_producer(stack.kafka, role="test-metrics")
    await producer.start()
    try:
        await producer.send_and_wait(stack.kafka.topic(submitted.name), garbage, key=f"metrics-{answer.id}".encode())
    finally:
        await producer.stop()

    # The pre-filter classifies before it forwards the request, so its counters moved before the answer came.
    safety = scrape(urls["safety"])
    assert moved(before["safety"], safety, "kns_safety_verdicts_total", stage="pre", blocked="false") == 1
    assert moved(before["safety"], safety, "kns_safety_classify_seconds_count", stage="pre") >= 1
    billing = await scrape_until(urls["billing"], before["billing"], "kns_billing_usage_total")
    assert moved(before["billing"], billing, "kns_billing_usage_total", created="true") == 1
    abuse = await scrape_until(urls["abuse"], before["abuse"], "kns_dead_lettered_total", processor="abuse")
    assert moved(before["abuse"], abuse, "kns_dead_lettered_total", processor="abuse") == 1

    async def ours() -> list[dict[str, bytes]]:
        rows = await read_topic(stack.kafka, stack.kafka.topic(TOPICS.dead_letter.name), Raw)  # type: ignore[arg-type]
        return [dict(headers) for _, _, value, headers in rows if value == garbage]

    found = await wait_for(ours, timeout_s=20)
    assert found and {h["processor"] for h in found} >= {b"abuse"}
