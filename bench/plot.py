"""PNG plots of benchmark runs: latency distributions and throughput, one colour per target."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from bench.loadgen import Run


def _cdf(ax: Any, values: list[float], label: str) -> None:
    if not values:
        return
    ordered = sorted(values)
    ax.plot([v * 1000 for v in ordered], [(i + 1) / len(ordered) for i in range(len(ordered))], label=label)


def plot_runs(runs: list[Run], path: Path, title: str) -> Path:
    fig, (ttft, itl, tput) = plt.subplots(1, 3, figsize=(15, 4.2))
    for run in runs:
        good = [r for r in run.results if r.ok]
        label = f"{run.target.label or run.target.base_url} c={run.concurrency or run.rate}"
        _cdf(ttft, [r.ttft for r in good if r.ttft is not None], label)
        _cdf(itl, [g for r in good for g in r.itl], label)
    for ax, name in ((ttft, "TTFT (ms)"), (itl, "inter-token latency (ms)")):
        ax.set_xlabel(name)
        ax.set_ylabel("fraction of requests" if ax is ttft else "fraction of gaps")
        ax.set_xscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    labels = [f"{r.target.label or 'run'}\nc={r.concurrency or r.rate}" for r in runs]
    tput.bar(range(len(runs)), [r.summary()["output_tokens_per_s"] or 0 for r in runs])
    tput.set_xticks(range(len(runs)), labels, fontsize=7)
    tput.set_ylabel("output tokens / s")
    tput.grid(alpha=0.3, axis="y")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
