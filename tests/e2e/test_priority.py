"""Priority classes through Kafka on the real stack (issue 9 item 4): with the engine saturated by free-tier
requests, an enterprise request submitted later starts before every free request still queued when it arrived
(order from the worker's own start times, not wall-clock latencies), the free requests all complete, and each
class's queue depth is a worker metric."""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta

import httpx
import pytest

from runtime.settings import Settings
from schemas.events import ChatRequest
from schemas.topics import TOPICS
from tests.conftest import GATEWAY_PORT, SESSION, WORKER_ADMIN_PORT
from tests.e2e.conftest import MODEL, records_of, scrape, usage_events
from tests.helpers import ServiceProcess, wait_for

pytestmark = pytest.mark.e2e
URL = f"http://127.0.0.1:{GATEWAY_PORT}/v1/chat/completions"
#: the test worker batches 16 (KNS_ENGINE__MAX_NUM_SEQS): 16 free requests fill it, 8 more queue in Kafka
CAPACITY, QUEUED = 16, 8
#: the gate looks up the paused queues' ends at most every 20 ms, and the gateway stamps a request just before it
#: produces it: a free request that started within this of the enterprise request's creation may have been chosen
#: before the enterprise request was in Kafka
SLACK = timedelta(milliseconds=150)


class Timed:
    def __init__(self) -> None:
        self.request_id = ""
        self.first_token_at: float | None = None
        self.lines: list[str] = []
        self.status = 0


async def _stream(http: httpx.AsyncClient, secret: str, content: str, max_tokens: int, timed: Timed) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True}
    async with http.stream("POST", URL, json=body, headers={"Authorization": f"Bearer {secret}"}) as response:
        timed.status = response.status_code
        async for line in response.aiter_lines():
            if not line:
                continue
            if timed.first_token_at is None and '"content"' in line:
                timed.first_token_at = time.monotonic()
            if not timed.request_id and line.startswith("data: {"):
                timed.request_id = line.split('"id":"', 1)[1].split('"', 1)[0]
            timed.lines.append(line)


@pytest.mark.timeout(300)  # 24 streams of 64 tokens on 16 slots
async def test_enterprise_starts_before_the_free_requests_queued_ahead_of_it(
        make_caller, stack: Settings, gateway: ServiceProcess) -> None:  # type: ignore[no-untyped-def]
    free = make_caller(org=f"org-free-{SESSION}", tier="free")
    enterprise = make_caller(org=f"org-ent-{SESSION}", tier="enterprise")
    frees = [Timed() for _ in range(CAPACITY + QUEUED)]
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=100)) as http:
        running = [asyncio.create_task(_stream(http, free.secret, f"Write a long story about a city, part {i}.", 64,
                                               t)) for i, t in enumerate(frees)]
        # saturated: every slot streams, and the rest wait in the low class's queue
        assert await wait_for(lambda: sum(t.first_token_at is not None for t in frees) >= CAPACITY, timeout_s=120)
        # the queued free requests, as the autoscaler sees them (the gauge is refreshed every 0.1 s while the
        # engine is full: the 16th first token can come before the next refresh)
        depth = await wait_for(lambda: (d := _queue_depth()).get("low", 0) >= 1 and d, timeout_s=5)
        assert depth, _queue_depth()
        first = Timed()
        await _stream(http, enterprise.secret, "Say hello.", 8, first)
        await asyncio.gather(*running)

    assert first.status == 200 and first.lines[-1] == "data: [DONE]"
    # the starvation guard: every free request completes (none past the free tier's 30 s queue deadline)
    assert all(t.status == 200 and t.lines[-1] == "data: [DONE]" for t in frees), [t.lines[-2:] for t in frees]

    created = {r.request_id: r.created_at for r in await records_of(
        stack, TOPICS.requests_admitted_high, ChatRequest, lambda r: r.request_id == first.request_id)}
    (arrived,) = created.values()
    starts = {t.request_id: (await wait_for(lambda rid=t.request_id: usage_events(stack, rid), timeout_s=60))[0]
              .started_at for t in [*frees, first]}
    started = starts[first.request_id]
    queued_behind = [rid for rid, at in starts.items() if rid != first.request_id and at > arrived + SLACK]
    assert queued_behind, "no free request was still queued when the enterprise request arrived"
    assert all(starts[rid] >= started for rid in queued_behind), (
        f"free requests started after the enterprise request arrived ({arrived}) and before it ({started}): "
        f"{sorted(starts[rid] for rid in queued_behind if starts[rid] < started)}")


def _queue_depth() -> dict[str, float]:
    text = scrape(f"http://127.0.0.1:{WORKER_ADMIN_PORT}/metrics")
    depth = {}
    for line in text.splitlines():
        if line.startswith("kns_worker_queue_depth{"):
            label = line.split('priority="', 1)[1].split('"', 1)[0]
            depth[label] = float(line.rsplit(" ", 1)[1])
    return depth
