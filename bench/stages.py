"""Where a stream's time goes, from the services' own Prometheus histograms: the difference of their buckets over a
measured window gives each stage's quantiles (as bucket upper bounds: Prometheus resolution, not exact values)."""

from __future__ import annotations

from collections import defaultdict

import httpx
from prometheus_client.parser import text_string_to_metric_families

#: (metric, label filter) → stage name, in the order a request meets them
STAGES = (
    ("kns_kafka_hop_seconds", ("hop", "gateway_to_worker"), "Kafka hop gateway → worker"),
    ("kns_worker_ttft_seconds", None, "worker: consumed → first token"),
    ("kns_kafka_hop_seconds", ("hop", "worker_to_relay"), "Kafka hop worker → relay"),
    ("kns_gateway_ttft_seconds", None, "gateway: received → first token sent"),
    ("kns_gateway_inter_token_seconds", None, "gateway: gap between chunks sent"),
    ("kns_gc_pause_seconds", ("generation", "2"), "full GC pauses (gateway, workers)"),
)

Buckets = dict[str, dict[float, float]]


async def scrape(urls: list[str]) -> Buckets:
    """Cumulative bucket counts of every stage, summed over the services at ``urls``."""
    out: Buckets = defaultdict(lambda: defaultdict(float))
    async with httpx.AsyncClient(timeout=5) as client:
        for url in urls:
            text = (await client.get(url)).text
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    if not sample.name.endswith("_bucket"):
                        continue
                    for metric, label, stage in STAGES:
                        if sample.name == f"{metric}_bucket" and (
                                label is None or sample.labels.get(label[0]) == label[1]):
                            out[stage][float(sample.labels["le"])] += sample.value
    return out


def quantiles(before: Buckets, after: Buckets, qs: tuple[float, ...] = (0.5, 0.99)) -> dict[str, dict[str, float]]:
    """Per stage: its observations in the window and the upper bound of the bucket each quantile falls in."""
    out: dict[str, dict[str, float]] = {}
    for _, _, stage in STAGES:
        now = after.get(stage, {})
        diff = sorted((le, now[le] - before.get(stage, {}).get(le, 0.0)) for le in now)
        total = diff[-1][1] if diff else 0.0
        if not total:
            continue
        row: dict[str, float] = {"count": total}
        for q in qs:
            row[f"p{round(q * 100)}_le"] = next(le for le, cumulative in diff if cumulative >= q * total)
        out[stage] = row
    return out
