"""Relay capacity: how many token events per second one gateway process relays, and how many streams it holds.

A. Demultiplexer alone: a backlog of token events for many requests on one partition; one Relay consumes, decodes
   and routes it into the requests' collectors. Events per second, no HTTP.
B. The real path with a synthetic engine (tokens at a fixed rate per request, no model): worker → Kafka →
   gateway relay → SSE → clients, at growing numbers of concurrent streams, until TTFT p99 or ITL p99 passes a
   threshold. The clients (``bench.sse_client``, a minimal raw-socket SSE reader) run on the same 2-core machine,
   which caps what can be shown here; each level reports the CPU each process used.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from typing import Any

import httpx

from bench.cpu import CpuMeter
from bench.loadgen import Target, plan
from bench.servers import infra_pids, pipeline
from bench.sse_client import streams
from bench.workload import Shape
from producers.relay.demux import Relay
from runtime.kafka_clients import ensure_topics, make_admin, make_producer
from runtime.settings import Settings
from schemas.codec import codec_for
from schemas.events import TokenEvent
from schemas.token_batch import pack
from schemas.topics import TOPICS


async def demux_capacity(settings: Settings, events: int, requests: int, per_record: int = 1) -> dict[str, Any]:
    """``per_record``: deltas per record (1: one record per request per step, as v2 workers wrote; more: one
    engine step's deltas packed, as v3 workers write)."""
    kafka = settings.kafka.model_copy(update={"namespace": f"bench-demux-{uuid.uuid4().hex[:6]}",
                                              "producer_linger_ms": 20})
    await ensure_topics(kafka, [TOPICS.tokens])
    topic = kafka.topic(TOPICS.tokens.name)
    codec = codec_for(TokenEvent)
    ids = [f"req-{i}" for i in range(requests)]
    try:
        producer = make_producer(kafka, role="bench-demux")
        await producer.start()
        try:
            record: list[TokenEvent] = []
            for i in range(events):
                rid = ids[i % requests]
                seq = i // requests
                record.append(TokenEvent(request_id=rid, attempt=1, seq=seq, token_offset=seq, token_ids=[7],
                                         text=" tok", worker_id="bench", emitted_at_us=0))
                if len(record) == per_record or i == events - 1 or (i + 1) % requests == 0:  # a step ends
                    key = rid.encode() if len(record) == 1 else None
                    await producer.send(topic, codec.encode_dict(pack(record)), key=key, partition=0)
                    record = []
            await producer.flush()
        finally:
            await producer.stop()
        relay = Relay(kafka, topic, 0)
        collectors = [relay.register(rid) for rid in ids]
        started = time.perf_counter()
        await relay.start(from_offset=0)
        # Polls counters the relay updates as it routes; nothing signals "all routed".
        while sum(c.delivered for c in collectors) < events:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        elapsed = time.perf_counter() - started
        await relay.stop()
        return {"events": events, "requests": requests, "deltas_per_record": per_record, "seconds": round(elapsed, 3),
                "events_per_s": round(events / elapsed)}
    finally:
        admin = make_admin(kafka)
        await admin.start()
        try:
            await admin.delete_topics([topic])
        finally:
            await admin.close()


async def stream_capacity(settings: Settings, levels: list[int], tokens: int, rate: float, ttft_limit_s: float,
                          itl_limit_s: float, report: Any, record_version: int = 3) -> dict[str, Any]:
    """``record_version``: the worker's token records (2: one per request per step, 3: one per step)."""
    namespace = f"bench-relay-{uuid.uuid4().hex[:6]}"
    secret, procs = await pipeline(settings, namespace=namespace, gateway_port=8020, worker_port=8120, prefix="relay",
                                   extra_env={"KNS_ENGINE__KIND": "synthetic",
                                              "KNS_ENGINE__SYNTHETIC_TOKENS_PER_S": str(rate),
                                              "KNS_ENGINE__SYNTHETIC_MAX_SEQS": str(max(levels)),
                                              "KNS_WORKER__TOKEN_RECORD_VERSION": str(record_version),
                                              "KNS_OBSERVABILITY__LOG_LEVEL": "WARNING"})
    infra = infra_pids(settings)
    out: dict[str, Any] = {"tokens_per_stream": tokens, "tokens_per_s_per_stream": rate,
                           "record_version": record_version,
                           "limits": {"ttft_p99_s": ttft_limit_s, "itl_p99_s": itl_limit_s}, "levels": []}
    try:
        for proc in procs:
            proc.start()
        await asyncio.gather(*(p.wait() for p in procs))
        target = Target("http://127.0.0.1:8020/v1", settings.model.served_name, secret, label="synthetic")
        for n in levels:
            report(f"{n} concurrent streams")
            before = await _routed()
            run = plan(target, Shape("fixed", n, 8, tokens), concurrency=n)
            meter = CpuMeter({**{p.name: p.pid for p in procs if p.pid}, **infra, "clients": os.getpid()},
                             alone=frozenset({"clients"}))
            run.results, run.wall_s = await streams(target.base_url, secret, target.model, n, tokens)
            cpu = meter.since()
            after = await _routed()
            s = run.summary()
            level = {"streams": n, "completed": s["completed"], "errors": s["errors"], "wall_s": s["wall_s"],
                     "relayed_events_per_s": round((after - before) / s["wall_s"]) if s["wall_s"] else None,
                     "ttft_s": s["ttft_s"], "itl_s": s["itl_s"],
                     "cpu_cores": {k: round(v / s["wall_s"], 2) for k, v in cpu.items() if v / s["wall_s"] >= 0.01}}
            relayed = after - before
            gateway_cpu = sum(v for k, v in cpu.items() if k.startswith("relay-gateway"))  # its supervisor's too
            level["gateway_us_per_event"] = round(gateway_cpu / relayed * 1e6, 1) if gateway_cpu and relayed else None
            level["ok"] = (s["completed"] == n and (s["ttft_s"]["p99"] or 1e9) <= ttft_limit_s
                           and (s["itl_s"]["p99"] or 1e9) <= itl_limit_s)
            out["levels"].append(level)
            if not level["ok"]:
                break
        passing = [lv for lv in out["levels"] if lv["ok"]]
        out["max_streams_within_limits"] = passing[-1]["streams"] if passing else 0
        out["max_relayed_events_per_s"] = max((lv["relayed_events_per_s"] or 0) for lv in out["levels"])
        return out
    finally:
        for proc in procs:
            proc.stop()


async def _routed() -> float:
    async with httpx.AsyncClient(timeout=5) as client:
        text = (await client.get("http://127.0.0.1:8020/metrics")).text
    for line in text.splitlines():
        if line.startswith('kns_relay_events_total{kind="routed"}'):
            return float(line.split()[-1])
    return 0.0
