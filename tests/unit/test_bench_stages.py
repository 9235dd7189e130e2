"""Stage figures of the benchmarks from the services' own histograms: exact means from their sums and counts,
quantile bounds from their buckets, over a window between two scrapes, summed over services."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from bench.stages import Snapshot, add_exposition, means_ms, quantiles


def exposition(hops: list[float], limiter: dict[str, list[float]]) -> str:
    registry = CollectorRegistry()
    hop = Histogram("kns_kafka_hop_seconds", "hop", ["hop"], registry=registry, buckets=(0.001, 0.005, 0.01))
    admission = Histogram("kns_limiter_seconds", "admission", ["limiter"], registry=registry)
    for seconds in hops:
        hop.labels(hop="gateway_to_worker").observe(seconds)
    hop.labels(hop="worker_to_relay").observe(1.0)  # another stage: never mixed in
    for which, observed in limiter.items():
        for seconds in observed:
            admission.labels(limiter=which).observe(seconds)
    return generate_latest(registry).decode()


def snapshot(*texts: str) -> Snapshot:
    out = Snapshot()
    for text in texts:
        add_exposition(out, text)
    return out


def test_means_count_only_the_window_and_sum_the_services() -> None:
    before = snapshot(exposition([0.010], {"shared": [0.5]}), exposition([], {}))
    after = snapshot(exposition([0.010, 0.002, 0.004], {"shared": [0.5, 0.001], "local": [0.2]}),
                     exposition([0.003], {}))
    means = means_ms(before, after)
    assert means["Kafka hop gateway → worker"] == {"count": 3, "mean_ms": 3.0}
    assert means["gateway: admission (the shared limiter, Redis)"] == {"count": 1, "mean_ms": 1.0}
    assert "Kafka hop worker → relay" not in means  # observed before the window only


def test_quantiles_give_the_bucket_bound_of_the_window() -> None:
    before = snapshot(exposition([0.008, 0.008], {}))
    after = snapshot(exposition([0.008, 0.008, 0.0005, 0.0005, 0.004], {}))
    row = quantiles(before, after)["Kafka hop gateway → worker"]
    assert row == {"count": 3, "p50_le": 0.001, "p99_le": 0.005}
