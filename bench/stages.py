"""Where a stream's time goes, from the services' own Prometheus histograms: the difference of their buckets over a
measured window gives each stage's quantiles (as bucket upper bounds: Prometheus resolution, not exact values)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

#: (metric, label filter) → stage name, in the order a request meets them
STAGES = (
    ("kns_gateway_prompt_seconds", None, "gateway: prompt rendering (chat template, tokenizer)"),
    ("kns_limiter_seconds", ("limiter", "shared"), "gateway: admission (the shared limiter, Redis)"),
    ("kns_kafka_hop_seconds", ("hop", "gateway_to_worker"), "Kafka hop gateway → worker"),
    ("kns_worker_claim_seconds", None, "worker: request claim (Redis)"),
    ("kns_worker_ttft_seconds", None, "worker: consumed → first token"),
    ("kns_kafka_hop_seconds", ("hop", "worker_to_relay"), "Kafka hop worker → relay"),
    ("kns_gateway_ttft_seconds", None, "gateway: received → first token sent"),
    ("kns_gateway_inter_token_seconds", None, "gateway: gap between chunks sent"),
    ("kns_gc_pause_seconds", ("generation", "2"), "full GC pauses (gateway, workers)"),
)

Buckets = dict[str, dict[float, float]]


@dataclass
class Snapshot:
    """Each stage's cumulative histogram, summed over the services scraped: buckets, and the sum and count of
    its observations (exact means, where buckets give only bounds)."""

    buckets: Buckets = field(default_factory=lambda: defaultdict(lambda: defaultdict(float)))
    sums: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    counts: dict[str, float] = field(default_factory=lambda: defaultdict(float))


def _stage(metric: str, labels: dict[str, str]) -> str | None:
    for name, label, stage in STAGES:
        if metric == name and (label is None or labels.get(label[0]) == label[1]):
            return stage
    return None


async def scrape(urls: list[str]) -> Snapshot:
    """Every stage's histogram now, summed over the services at ``urls``."""
    out = Snapshot()
    async with httpx.AsyncClient(timeout=5) as client:
        for url in urls:
            add_exposition(out, (await client.get(url)).text)
    return out


def add_exposition(out: Snapshot, text: str) -> None:
    """Add one service's metrics (Prometheus text format) to ``out``."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            metric, _, kind = sample.name.rpartition("_")
            if (stage := _stage(metric, sample.labels)) is None:
                continue
            if kind == "bucket":
                out.buckets[stage][float(sample.labels["le"])] += sample.value
            elif kind == "sum":
                out.sums[stage] += sample.value
            elif kind == "count":
                out.counts[stage] += sample.value


def quantiles(before: Snapshot, after: Snapshot, qs: tuple[float, ...] = (0.5, 0.99)) -> dict[str, dict[str, float]]:
    """Per stage: its observations in the window and the upper bound of the bucket each quantile falls in."""
    out: dict[str, dict[str, float]] = {}
    for _, _, stage in STAGES:
        now = after.buckets.get(stage, {})
        diff = sorted((le, now[le] - before.buckets.get(stage, {}).get(le, 0.0)) for le in now)
        total = diff[-1][1] if diff else 0.0
        if not total:
            continue
        row: dict[str, float] = {"count": total}
        for q in qs:
            row[f"p{round(q * 100)}_le"] = next(le for le, cumulative in diff if cumulative >= q * total)
        out[stage] = row
    return out


def means_ms(before: Snapshot, after: Snapshot) -> dict[str, dict[str, float]]:
    """Per stage: its observations in the window and their exact mean, in milliseconds."""
    out: dict[str, dict[str, float]] = {}
    for _, _, stage in STAGES:
        count = after.counts.get(stage, 0.0) - before.counts.get(stage, 0.0)
        if count > 0:
            total = after.sums.get(stage, 0.0) - before.sums.get(stage, 0.0)
            out[stage] = {"count": count, "mean_ms": round(total / count * 1000, 2)}
    return out
