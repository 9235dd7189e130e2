"""The capacity model (``docs/CAPACITY.md``): how big a fleet a load needs, from per-component figures measured
by the benchmarks (``bench/results``) and assumptions stated here, each one a named field.

Measured (the newest result of each kind that has the figure):

* gateway CPU per accepted request and per relayed token event: a least-squares fit of the gateway's CPU seconds
  over the levels of the newest ``kns bench relay`` result with v3 token records (its levels differ in tokens per
  stream, which separates the two: part B's busy streams against part C's short idle ones);
* streams one gateway process holds within TTFT p99 < 1 s (``kns bench relay --held``, else its part B);
* Kafka records and bytes per generated token at the highest concurrency (``kns bench transport``, v3).

Assumed (hardware this machine does not have): broker, Cassandra node and Redis shard throughput, GPU HBM size and
bandwidth, model shapes, prompt and answer lengths, and the utilisation every component is planned at.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"
BEGIN, END = "<!-- capacity:begin -->", "<!-- capacity:end -->"


@dataclass(frozen=True)
class Measured:
    gateway_s_per_request: float
    gateway_s_per_event: float
    streams_per_gateway: int
    records_per_token: float
    bytes_per_token: float
    sources: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Model:
    name: str
    params_b: float
    layers: int
    kv_heads: int
    head_dim: int
    #: GPUs one replica is split over (tensor parallel)
    tp: int
    bytes_per_param: float = 2.0  # bf16

    @property
    def weight_bytes(self) -> float:
        return self.params_b * 1e9 * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> float:
        return 2 * self.layers * self.kv_heads * self.head_dim * 2  # K and V, bf16


@dataclass(frozen=True)
class Assumptions:
    #: every component is planned at this share of what it can do (headroom for peaks and failures)
    utilisation: float = 0.6
    #: prompt and answer of a mean request
    prompt_tokens: int = 1000
    request_event_bytes: int = 6000
    #: Kafka: replication factor, and what one broker writes per second (its own + replica traffic; NVMe, 25 GbE)
    replication: int = 3
    broker_write_mb_s: float = 400.0
    broker_records_s: float = 1_000_000.0
    #: Kafka bytes per request besides its tokens (usage, ledger, control, audit events)
    other_event_bytes_per_request: int = 2000
    #: Cassandra: rows written per request (ledger row, usage, stored completion or conversation items) and
    #: replicated writes one node applies per second
    cassandra_writes_per_request: float = 3.0
    cassandra_writes_per_node_s: float = 25_000.0
    #: Redis: commands per request (key check, admission script, stream record, settlement, spend) and per shard
    redis_ops_per_request: float = 8.0
    redis_ops_per_shard_s: float = 80_000.0
    #: the GPU: H100 SXM
    hbm_bytes: float = 80e9
    hbm_bytes_per_s: float = 3.35e12
    bf16_flops: float = 989e12
    #: the share of peak FLOPs prefill reaches, and of HBM bandwidth decode reaches
    mfu: float = 0.5
    mbu: float = 0.7
    #: mean tokens a decoding sequence has in its KV cache (prompt + half its answer)
    mean_context_tokens: int = 1500
    #: cores per gateway host
    cores_per_host: int = 32
    #: worker replicas per cell: a cell has its own work-queue topics (one consumer group each), so that no topic
    #: needs more partitions than a cell has replicas (Kafka's guidance: a few thousand partitions per broker)
    replicas_per_cell: int = 256


MODELS = (Model("Llama-3-8B", 8.0, 32, 8, 128, tp=1), Model("Llama-3-70B", 70.6, 80, 8, 128, tp=4))


@dataclass(frozen=True)
class Load:
    name: str
    requests_per_s: float
    output_tokens_per_s: float


LOADS = (Load("seeds' peak", 50_000, 50_000_000), Load("10x smaller", 5_000, 5_000_000))


def _newest(kind: str) -> list[Path]:
    return sorted(RESULTS.glob(f"{kind}-*.json"), reverse=True)


def _gateway_cpu_levels() -> tuple[list[tuple[float, float, float]], list[str]]:
    """(requests, relayed events, gateway CPU seconds) of every v3 level of the newest relay result that has at
    least two (one run of one version of the code: older files measured other code), and that file."""
    for path in _newest("relay"):
        data = json.loads(path.read_text())
        rows = []
        for run in data.get("stream_runs") or []:
            if run.get("record_version") != 3:
                continue
            for level in run["levels"]:
                wall = level["wall_s"]
                cores = sum(v for k, v in level["cpu_cores"].items() if k.startswith("relay-gateway"))
                events = (level["relayed_events_per_s"] or 0) * wall
                if cores and events:
                    rows.append((float(level["completed"]), events, cores * wall))
        if len(rows) >= 2:
            return rows, [path.name]
    return [], []


def _streams_per_process() -> int:
    """Streams one gateway process held within the limits: the newest idle-heavy run (``--held``: what chat
    traffic is), else the busiest part-B level of the newest file that has one within them (a part-B run of a few
    busy streams says nothing of how many idle ones a process holds, so it never hides an idle-heavy result)."""
    results = [json.loads(path.read_text()) for path in _newest("relay")]
    for data in results:
        held = data.get("held")
        if held and held.get("max_streams_within_limits"):
            return int(held["max_streams_within_limits"] // held.get("gateway_processes", 1))
    for data in results:
        streams = max((run.get("max_streams_within_limits", 0) // run.get("gateway_processes", 1)
                       for run in data.get("stream_runs") or []), default=0)
        if streams:
            return int(streams)
    return 0


def measured() -> Measured:
    rows, relay_files = _gateway_cpu_levels()
    if not rows:
        raise FileNotFoundError("no v3 relay results in bench/results: run kns bench relay first")
    a = np.array([[r, e] for r, e, _ in rows])
    b = np.array([c for _, _, c in rows])
    (per_request, per_event), *_ = np.linalg.lstsq(a, b, rcond=None)
    if per_request <= 0 or per_event <= 0:  # levels too alike to separate the two: all of it per event
        per_request, per_event = 0.0, float(b.sum() / a[:, 1].sum())
    streams = _streams_per_process()
    transport = json.loads(_newest("transport")[0].read_text())
    v3 = max((r for r in transport["rows"] if r["version"] == 3), key=lambda r: r["concurrency"])
    return Measured(float(per_request), float(per_event), streams, v3["records_per_token"], v3["bytes_per_token"],
                    {"relay": ", ".join(relay_files), "transport": _newest("transport")[0].name,
                     "transport_concurrency": str(v3["concurrency"])})


def gpus(model: Model, load: Load, a: Assumptions) -> dict[str, Any]:
    """Decode from the HBM-bandwidth bound (a step reads the weights once and every sequence's KV cache), prefill
    from the FLOPs bound; the batch is what HBM holds beside the weights."""
    per_gpu_weights = model.weight_bytes / model.tp
    kv_per_seq = model.kv_bytes_per_token * a.mean_context_tokens / model.tp
    batch = max(1, int((a.hbm_bytes * 0.9 - per_gpu_weights) / kv_per_seq))
    step_s = (per_gpu_weights + batch * kv_per_seq) / (a.hbm_bytes_per_s * a.mbu)
    decode_per_replica = batch / step_s
    decode_gpus = load.output_tokens_per_s / decode_per_replica * model.tp
    prefill_flops = 2 * model.params_b * 1e9 * a.prompt_tokens * load.requests_per_s
    prefill_gpus = prefill_flops / (a.bf16_flops * a.mfu)
    return {"model": model.name, "tp": model.tp, "batch_per_replica": batch,
            # batch 1: every token reads all the weights once, split over the replica's GPUs
            "batch1_tok_s_bound": round(a.hbm_bytes_per_s * model.tp / model.weight_bytes, 1),
            "decode_tok_s_per_replica": round(decode_per_replica), "per_stream_tok_s": round(1 / step_s, 1),
            "decode_gpus": math.ceil(decode_gpus / a.utilisation),
            "prefill_gpus": math.ceil(prefill_gpus / a.utilisation),
            "gpus": math.ceil((decode_gpus + prefill_gpus) / a.utilisation)}


def plan(load: Load, m: Measured, a: Assumptions, model: Model) -> dict[str, Any]:
    gpu = gpus(model, load, a)
    tokens_per_request = load.output_tokens_per_s / load.requests_per_s
    stream_s = tokens_per_request / gpu["per_stream_tok_s"]
    concurrent_streams = load.requests_per_s * stream_s
    gateway_cores = load.requests_per_s * m.gateway_s_per_request + load.output_tokens_per_s * m.gateway_s_per_event
    by_cpu = gateway_cores / a.utilisation
    by_streams = concurrent_streams / (m.streams_per_gateway * a.utilisation) if m.streams_per_gateway else 0.0
    gateway_processes = math.ceil(max(by_cpu, by_streams))
    token_bytes = load.output_tokens_per_s * m.bytes_per_token
    token_records = load.output_tokens_per_s * m.records_per_token
    other_bytes = load.requests_per_s * (a.request_event_bytes + a.other_event_bytes_per_request)
    ingress_mb_s = (token_bytes + other_bytes) / 1e6
    brokers = math.ceil(max(ingress_mb_s * a.replication / a.broker_write_mb_s,
                            (token_records + 4 * load.requests_per_s) * a.replication / a.broker_records_s)
                        / a.utilisation)
    replicas = gpu["gpus"] // model.tp
    cells = math.ceil(replicas / a.replicas_per_cell)
    return {
        "load": load.name, "requests_per_s": load.requests_per_s, "output_tokens_per_s": load.output_tokens_per_s,
        "concurrent_streams": round(concurrent_streams),
        "gateway": {"cores": round(gateway_cores), "processes": gateway_processes,
                    "bound_by": "CPU" if by_cpu >= by_streams else "streams held",
                    "hosts": math.ceil(gateway_processes / a.cores_per_host)},
        "kafka": {"ingress_mb_s": round(ingress_mb_s), "token_records_per_s": round(token_records),
                  "brokers": max(brokers, a.replication),
                  # one reply partition per gateway process (+25 % to add processes without a reassignment)
                  "token_partitions": math.ceil(gateway_processes * 1.25),
                  # every worker replica of a cell consumes its share of each priority class's queue of the cell
                  "cells": cells, "request_partitions_per_class": math.ceil(replicas / cells)},
        "cassandra_nodes": max(a.replication, math.ceil(load.requests_per_s * a.cassandra_writes_per_request
                                                        * a.replication / a.cassandra_writes_per_node_s
                                                        / a.utilisation)),
        "redis_shards": math.ceil(load.requests_per_s * a.redis_ops_per_request / a.redis_ops_per_shard_s
                                  / a.utilisation),
        "gpu": gpu,
    }


def report(a: Assumptions = Assumptions()) -> dict[str, Any]:
    m = measured()
    return {"measured": asdict(m), "assumptions": asdict(a),
            "plans": [plan(load, m, a, model) for load in LOADS for model in MODELS]}


def markdown(result: dict[str, Any]) -> str:
    m = result["measured"]
    lines = [
        "Measured on this machine (2 cores; `kns bench capacity` recomputes this section from `bench/results`):",
        "",
        f"- gateway CPU: **{m['gateway_s_per_request'] * 1e3:.2f} ms per accepted request** + "
        f"**{m['gateway_s_per_event'] * 1e6:.1f} µs per relayed token event** "
        f"(least-squares fit over {m['sources']['relay']})",
        f"- streams one gateway process holds within TTFT p99 < 1 s: **{m['streams_per_gateway']:,}**",
        f"- Kafka per generated token (v3 records, c={m['sources']['transport_concurrency']}, "
        f"{m['sources']['transport']}): **{m['records_per_token']:.3f} records, {m['bytes_per_token']:.0f} bytes**",
        "",
        "| load | model | concurrent streams | gateway cores | gateway processes (bound) | Kafka brokers | "
        "token partitions | worker cells x request partitions / class | Cassandra nodes | Redis shards | "
        "GPUs (decode + prefill) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in result["plans"]:
        g = p["gpu"]
        lines.append(
            f"| {p['load']} ({p['requests_per_s']:,.0f} req/s, {p['output_tokens_per_s'] / 1e6:g}M tok/s) | "
            f"{g['model']} (TP {g['tp']}) | {p['concurrent_streams']:,} | {p['gateway']['cores']:,} | "
            f"{p['gateway']['processes']:,} ({p['gateway']['bound_by']}) | {p['kafka']['brokers']} "
            f"({p['kafka']['ingress_mb_s']:,} MB/s in) | {p['kafka']['token_partitions']:,} | "
            f"{p['kafka']['cells']} x {p['kafka']['request_partitions_per_class']:,} | {p['cassandra_nodes']} | "
            f"{p['redis_shards']} | "
            f"{g['gpus']:,} ({g['decode_gpus']:,} + {g['prefill_gpus']:,}) |")
    lines += ["", "| model | batch per replica (HBM) | decode tok/s per replica | tok/s per stream | "
              "batch-1 bound tok/s |", "|---|---|---|---|---|"]
    seen = set()
    for p in result["plans"]:
        g = p["gpu"]
        if g["model"] not in seen:
            seen.add(g["model"])
            lines.append(f"| {g['model']} (TP {g['tp']}) | {g['batch_per_replica']} | "
                         f"{g['decode_tok_s_per_replica']:,} | {g['per_stream_tok_s']} | {g['batch1_tok_s_bound']} |")
    lines += ["", "Assumptions: " + ", ".join(f"`{k}` = {v:,}" if isinstance(v, int | float) else f"`{k}` = {v}"
                                             for k, v in result["assumptions"].items())]
    return "\n".join(lines)


def write_into(doc: Path, text: str) -> None:
    """Replace the section between the markers of ``doc``."""
    content = doc.read_text()
    head, _, rest = content.partition(BEGIN)
    _, _, tail = rest.partition(END)
    doc.write_text(f"{head}{BEGIN}\n{text}\n{END}{tail}")
