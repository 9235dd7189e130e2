"""Priority classes under saturation, side by side: the same load with the worker's priority gate on and off.

One worker (synthetic engine: ``slots`` requests at once, 20 tokens/s each) and one gateway in a namespace of their
own. A backlog of free-tier requests is sent at once (several times what the engine holds), then enterprise
requests arrive one at a time while it drains. Reported per class: time to first token (the queue wait, p50/p99)
and how many completed; the free requests' last first token says how long the backlog took. The load client
runs in this process; with the synthetic engine the queue wait (seconds) dwarfs its CPU cost.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from typing import Any

import httpx

from bench.common import percentiles
from bench.servers import pipeline
from producers.tenancy.admin import UNLIMITED, KeyCreate, open_admin
from runtime.kafka_clients import ensure_topics
from runtime.settings import Settings
from schemas.topics import TOPICS

Say = Callable[[str], None]


async def _stream(http: httpx.AsyncClient, url: str, secret: str, tokens: int, model: str
                  ) -> tuple[float | None, bool]:
    """(seconds to the first token, completed)."""
    body = {"model": model, "messages": [{"role": "user", "content": "Count."}], "max_tokens": tokens,
            "stream": True}
    started = time.perf_counter()
    first: float | None = None
    async with http.stream("POST", f"{url}/chat/completions", json=body,
                           headers={"Authorization": f"Bearer {secret}"}) as response:
        if response.status_code != 200:
            await response.aread()
            return None, False
        last = ""
        async for line in response.aiter_lines():
            if first is None and '"content"' in line:
                first = time.perf_counter() - started
            last = line or last
    return first, last == "data: [DONE]"


async def one_run(settings: Settings, *, gate: bool, slots: int, backlog: int, urgent: int, tokens: int,
                  port: int, say: Say) -> dict[str, Any]:
    namespace = f"benchprio{uuid.uuid4().hex[:6]}"
    kafka = settings.kafka.model_copy(update={"namespace": namespace})
    await ensure_topics(kafka, TOPICS.all())
    _secret, procs = await pipeline(settings, namespace=namespace, gateway_port=port, worker_port=port + 1,
                                    prefix="prio", extra_env={
                                        "KNS_ENGINE__KIND": "synthetic", "KNS_ENGINE__SYNTHETIC_MAX_SEQS": str(slots),
                                        "KNS_ENGINE__SYNTHETIC_TOKENS_PER_S": "20",
                                        "KNS_WORKER__PRIORITY_CLASSES": str(gate).lower(),
                                        "KNS_TENANCY__TIERS__FREE__QUEUE_DEADLINE_S": "600"})
    async with open_admin(settings.model_copy(update={"kafka": kafka})) as admin:
        free = (await admin.issue_key(f"org-prio-free-{namespace}", "free", KeyCreate(name="free"),
                                      limits=UNLIMITED)).secret
        enterprise = (await admin.issue_key(f"org-prio-ent-{namespace}", "enterprise", KeyCreate(name="ent"),
                                            limits=UNLIMITED)).secret
    for proc in procs:
        proc.start()
    try:
        await asyncio.gather(*(proc.wait(300) for proc in procs))
        url, model = f"http://127.0.0.1:{port}/v1", settings.model.served_name
        async with httpx.AsyncClient(timeout=900, limits=httpx.Limits(max_connections=backlog + urgent + 8)) as http:
            await _stream(http, url, enterprise, 2, model)  # warm-up
            say(f"gate {'on' if gate else 'off'}: {backlog} free requests at once, then {urgent} enterprise ones")
            frees = [asyncio.create_task(_stream(http, url, free, tokens, model)) for _ in range(backlog)]
            await asyncio.sleep(1.0)  # the backlog is in Kafka, the engine full
            urgent_tasks = []
            for _ in range(urgent):
                urgent_tasks.append(asyncio.create_task(_stream(http, url, enterprise, tokens, model)))
                await asyncio.sleep(0.5)
            free_done = await asyncio.gather(*frees)
            urgent_done = await asyncio.gather(*urgent_tasks)
        return {"gate": gate, "namespace": namespace, **{name: {
            "sent": len(done), "completed": sum(ok for _, ok in done),
            "ttft_s": percentiles([t for t, _ in done if t is not None])}
            for name, done in (("free", free_done), ("enterprise", urgent_done))}}
    finally:
        for proc in procs:
            proc.stop()


async def run(settings: Settings, *, slots: int = 8, backlog: int = 64, urgent: int = 12, tokens: int = 20,
              port: int = 18350, say: Say = lambda _m: None) -> dict[str, Any]:
    shape = {"slots": slots, "backlog": backlog, "urgent": urgent, "tokens": tokens, "tokens_per_s": 20}
    runs = [await one_run(settings, gate=gate, slots=slots, backlog=backlog, urgent=urgent, tokens=tokens,
                          port=port, say=say) for gate in (True, False)]
    p50 = [r["enterprise"]["ttft_s"]["p50"] for r in runs]
    return {"shape": shape, "runs": runs,
            "enterprise_wait_p50_off_over_on": round(p50[1] / p50[0], 1) if p50[0] and p50[1] else None,
            "notes": "synthetic engine; gate off = every class's partitions fetched alike (arrival order)"}
