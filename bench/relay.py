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
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any

import httpx
import orjson

from bench.common import percentiles
from bench.cpu import CpuMeter
from bench.loadgen import RequestResult, Target, plan
from bench.servers import Proc, infra_pids, pin_threads, pinned, pipeline, wait_healthy
from bench.stages import means_ms, quantiles, scrape
from bench.workload import Shape
from producers.relay.demux import Relay
from runtime.kafka_clients import ensure_topics, make_admin, make_producer
from runtime.settings import REPO_ROOT, Settings
from schemas.codec import codec_for
from schemas.events import TokenEvent
from schemas.token_batch import pack
from schemas.topics import TOPICS

WORKER_PORT = 8120
#: what writes the token records in part B
SOURCES = {"worker": "synthetic-engine workers (ops.cli worker)",
           "tokens": "bench.token_source: the workers' TokenSink on one clock, no intake, engine or finalizer"}


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


@dataclass(frozen=True)
class Placement:
    """Which cores run what: the gateway gets cores of its own, the load (clients, worker, Kafka, Cassandra,
    Redis) the others, so that the clients do not take the measured process's CPU (empty: nothing pinned)."""

    gateway_cpus: str = ""
    load_cpus: str = ""

    @classmethod
    def split(cls) -> Placement:
        """The last core for the gateway, the others for the load (nothing pinned on a 1-core machine)."""
        cores = sorted(os.sched_getaffinity(0))
        if len(cores) < 2:
            return cls()
        return cls(str(cores[-1]), ",".join(map(str, cores[:-1])))

    def describe(self) -> str:
        if not self.gateway_cpus:
            return "nothing pinned: clients, worker, Kafka and the gateway share every core"
        return (f"gateway pinned to CPU {self.gateway_cpus}; clients (a process of their own), worker, Kafka, "
                f"Cassandra and Redis pinned to CPU {self.load_cpus}")


async def stream_capacity(settings: Settings, levels: list[int], tokens: int, rate: float, ttft_limit_s: float,
                          itl_limit_s: float, report: Any, record_version: int = 3, ramp_s: float = 0.0,
                          gateway_processes: int = 1, placement: Placement = Placement(), workers: int = 1,
                          max_seqs: int | None = None, source: str = "worker") -> dict[str, Any]:
    """``record_version``: the worker's token records (2: one per request per step, 3: one per step);
    ``ramp_s``: each level's streams start evenly over this long (0: at once); ``max_seqs``: the sequences each
    (synthetic) worker runs at once (default: the highest level, so that the worker never queues); ``source``:
    ``worker`` (synthetic-engine workers) or ``tokens`` (``bench.token_source`` in their place: the same records
    at a fraction of the load core's CPU, for what the gateway relays)."""
    if source not in SOURCES:
        raise ValueError(f"source: one of {', '.join(SOURCES)}")
    if source == "tokens" and (workers != 1 or record_version != 3):
        raise ValueError("the token source stands in for one worker writing v3 records")
    namespace = f"bench-relay-{uuid.uuid4().hex[:6]}"
    port = 8020
    secret, procs = await pipeline(settings, namespace=namespace, gateway_port=port, worker_port=WORKER_PORT,
                                   prefix="relay",
                                   gateway_processes=gateway_processes, gateway_cpus=placement.gateway_cpus,
                                   worker_cpus=placement.load_cpus, workers=workers,
                                   extra_env={"KNS_ENGINE__KIND": "synthetic",
                                              "KNS_ENGINE__SYNTHETIC_TOKENS_PER_S": str(rate),
                                              "KNS_ENGINE__SYNTHETIC_MAX_SEQS": str(max_seqs or max(levels)),
                                              "KNS_WORKER__TOKEN_RECORD_VERSION": str(record_version),
                                              "KNS_OBSERVABILITY__LOG_LEVEL": "WARNING"})
    if source == "tokens":
        procs = [_token_source(procs[-1].env, rate, placement.load_cpus), procs[-1]]
    # each gateway process's internal port (its metrics): the fleet's own ports, or the one process's port + 50
    metrics_ports = [port + 50 + i for i in range(gateway_processes)]
    infra = infra_pids(settings)
    out: dict[str, Any] = {"tokens_per_stream": tokens, "tokens_per_s_per_stream": rate, "ramp_s": ramp_s,
                           "record_version": record_version, "gateway_processes": gateway_processes,
                           "source": SOURCES[source],
                           "workers": workers, "placement": placement.describe(),
                           "limits": {"ttft_p99_s": ttft_limit_s, "itl_p99_s": itl_limit_s}, "levels": []}
    try:
        if placement.load_cpus:
            pin_threads(infra, _cpu_set(placement.load_cpus))
        for proc in procs:
            proc.start()
        await asyncio.gather(*(p.wait() for p in procs))
        for metrics_port in metrics_ports:  # every process serves (the health URL waited for the last one)
            if not await wait_healthy(f"http://127.0.0.1:{metrics_port}/health", 120):
                raise RuntimeError(f"the gateway process on port {metrics_port} did not serve within 120 s")
        for n in levels:
            report(f"{n} concurrent streams")
            level = await _level(n, tokens, rate, ramp_s, secret, settings.model.served_name, port, metrics_ports,
                                 procs, infra, placement, workers)
            level["ok"] = (level["completed"] == n and (level["ttft_s"]["p99"] or 1e9) <= ttft_limit_s
                           and (level["itl_s"]["p99"] or 1e9) <= itl_limit_s)
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
        if placement.load_cpus:
            pin_threads(infra, os.sched_getaffinity(0))


def _token_source(env: dict[str, str], rate: float, cpus: str) -> Proc:
    return Proc("relay-source", [*pinned(cpus), sys.executable, "-m", "bench.token_source", str(WORKER_PORT),
                                 str(rate)], env, f"http://127.0.0.1:{WORKER_PORT}/health")


async def _level(n: int, tokens: int, rate: float, ramp_s: float, secret: str, model: str, port: int,
                 metrics_ports: list[int], procs: list[Proc], infra: dict[str, int], placement: Placement,
                 workers: int = 1) -> dict[str, Any]:
    """One level: ``n`` streams from a client process of their own."""
    target = Target(f"http://127.0.0.1:{port}/v1", model, secret, label="synthetic")
    run = plan(target, Shape("fixed", min(n, 10_000), 8, tokens), concurrency=min(n, 10_000))
    stage_urls = [f"http://127.0.0.1:{p}/metrics"
                  for p in (*metrics_ports, *(WORKER_PORT + i for i in range(workers)))]
    worker_ports = [WORKER_PORT + i for i in range(workers)]
    before, stages_before = await _routed(metrics_ports), await scrape(stage_urls)
    tokens_before = await _counter(worker_ports, "kns_worker_tokens_out_total")
    clients = await asyncio.create_subprocess_exec(
        *pinned(placement.load_cpus), sys.executable, "-m", "bench.sse_client", target.base_url, secret, model,
        str(n), str(tokens), str(ramp_s), stdout=asyncio.subprocess.PIPE, cwd=REPO_ROOT)
    meter = CpuMeter({**{p.name: p.pid for p in procs if p.pid}, **infra})
    stdout, _ = await clients.communicate()
    cpu = meter.since()
    after, stages_after = await _routed(metrics_ports), await scrape(stage_urls)
    tokens_after = await _counter(worker_ports, "kns_worker_tokens_out_total")
    if clients.returncode != 0:
        raise RuntimeError(f"the client process exited with {clients.returncode}")
    data = orjson.loads(stdout)
    cpu["clients"] = data["cpu_s"]  # its own count: the process is gone by now
    run.results, run.wall_s = [RequestResult(**r) for r in data["results"]], data["wall_s"]
    s = run.summary()
    relayed = after - before
    gateway_cpu = sum(v for k, v in cpu.items() if k.startswith("relay-gateway"))  # its supervisors' too
    # Starved: a stream whose longest gap between chunks is far over its engine's (1 / rate).
    gaps = [max(r.itl) for r in run.results if r.ok and r.itl]
    return {"streams": n, "completed": s["completed"], "errors": s["errors"], "wall_s": s["wall_s"],
            "relayed_events_per_s": round(relayed / s["wall_s"]) if s["wall_s"] else None,
            "ttft_s": s["ttft_s"], "itl_s": s["itl_s"], "ttft_p99_s_by_tenth": _ttft_p99_by_tenth(run.results),
            "longest_gap_s": {"p50": _round(percentiles(gaps)["p50"]), "max": round(max(gaps), 3) if gaps else None,
                              "engine_gap_s": round(1 / rate, 3)},
            "gateway_cores_busy": round(gateway_cpu / s["wall_s"], 2) if s["wall_s"] else None,
            "gateway_us_per_event": round(gateway_cpu / relayed * 1e6, 1) if gateway_cpu and relayed else None,
            "cpu_cores": {k: round(v / s["wall_s"], 2) for k, v in cpu.items() if v / s["wall_s"] >= 0.01},
            "stages": quantiles(stages_before, stages_after),
            "stage_means_ms": means_ms(stages_before, stages_after),
            # how evenly the work queue's partitions spread the requests over the workers
            "tokens_per_worker": [round(b - a) for a, b in zip(tokens_before, tokens_after, strict=True)],
            # what each client received, counted on its side (a load side that lost or mangled streams shows here)
            "content_bytes_per_stream": [r.content_bytes for r in run.results]}


def _ttft_p99_by_tenth(results: list[RequestResult]) -> list[float | None]:
    """TTFT p99 of each tenth of the streams, in the order they started: whether slow first tokens come with the
    start, the ramp's end or throughout."""
    ordered = sorted((r for r in results if r.ok and r.ttft is not None), key=lambda r: r.started_at)
    n = len(ordered)
    # cut at n * i // 10: every stream in one tenth (an empty tenth, fewer than ten streams: None)
    return [_round(percentiles([r.ttft for r in ordered[n * i // 10:n * (i + 1) // 10] if r.ttft is not None])["p99"])
            for i in range(10)] if ordered else []


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def _cpu_set(cpus: str) -> set[int]:
    out: set[int] = set()
    for part in cpus.split(","):
        first, _, last = part.partition("-")
        out.update(range(int(first), int(last or first) + 1))
    return out


async def _routed(ports: list[int]) -> float:
    """Token events the gateway processes at ``ports`` routed to streams, in all."""
    return sum(await _counter(ports, 'kns_relay_events_total{kind="routed"}'))


async def _counter(ports: list[int], sample: str) -> list[float]:
    """One counter's value (``sample``: its name and labels as exposed) at each of ``ports``."""
    values = []
    async with httpx.AsyncClient(timeout=5) as client:
        for port in ports:
            text = (await client.get(f"http://127.0.0.1:{port}/metrics")).text
            values.append(next((float(line.split()[-1]) for line in text.splitlines()
                                if line.startswith(sample + " ")), 0.0))
    return values
