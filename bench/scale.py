"""Horizontal scaling on one box: synthetic-engine workers x gateway processes, the same load on each.

Each worker runs at most ``max_seqs`` sequences at ``rate`` tokens/s each, so the engines' capacity is
``workers x max_seqs x rate`` tokens/s; the load (``streams`` at once, in a client process of their own) asks for
more than one worker gives. Delivered tokens/s should then grow with the workers until something else saturates:
the report gives every process's CPU (and the box's cores) so that it says which. Nothing is pinned: on a machine
with few cores, the processes share them, which is the point of the measurement.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from bench.relay import stream_capacity
from runtime.settings import Settings


async def run(settings: Settings, *, workers: list[int], gateways: list[int], streams: int, tokens: int,
              rate: float, max_seqs: int, say: Callable[[str], None]) -> dict[str, Any]:
    cores = len(os.sched_getaffinity(0))
    rows = []
    for w in workers:
        for g in gateways:
            say(f"{w} worker(s), {g} gateway process(es)")
            result = await stream_capacity(settings, [streams], tokens, rate, 1e9, 1e9, lambda _: None,
                                           gateway_processes=g, workers=w, max_seqs=max_seqs)
            level = result["levels"][0]
            rows.append(_row(w, g, level, engine_tok_s=min(w * max_seqs, streams) * rate, cores=cores))
    return {"cores": cores, "streams": streams, "tokens_per_stream": tokens, "tokens_per_s_per_stream": rate,
            "max_seqs_per_worker": max_seqs, "rows": rows}


def _row(workers: int, gateways: int, level: dict[str, Any], engine_tok_s: float, cores: int) -> dict[str, Any]:
    busy: dict[str, float] = {}
    for name, value in level["cpu_cores"].items():
        group = ("gateway" if name.startswith("relay-gateway") else "workers" if name.startswith("relay-worker")
                 else name)
        busy[group] = round(busy.get(group, 0.0) + value, 2)
    total = round(sum(busy.values()), 2)
    tok_s = level["relayed_events_per_s"] or 0
    per_worker = level.get("tokens_per_worker") or []
    return {"workers": workers, "gateway_processes": gateways, "completed": level["completed"],
            "errors": level["errors"], "delivered_tok_s": tok_s, "engines_tok_s": engine_tok_s,
            "of_engines": round(tok_s / engine_tok_s, 2) if engine_tok_s else None,
            "tokens_per_worker": per_worker,
            # the busiest worker's share over an even one: the wall time is the busiest worker's
            "busiest_worker_load": round(max(per_worker) * len(per_worker) / sum(per_worker), 2)
            if per_worker and sum(per_worker) else None,
            "ttft_s": level["ttft_s"], "itl_s": level["itl_s"], "cpu_cores": busy, "cpu_total": total,
            "saturated": _saturated(busy, total, cores)}


def _saturated(busy: dict[str, float], total: float, cores: int) -> str:
    """Whether the box's CPU bounds a row (nearly every core busy); when it does not, the engines and how evenly
    the partitions spread the requests over them do (the busiest worker's load says how much)."""
    if total >= 0.85 * cores:
        top = max(busy, key=lambda k: busy[k])
        return f"CPU ({total:.2f} of {cores} cores busy; most: {top} {busy[top]:.2f})"
    return f"not the CPU ({total:.2f} of {cores} cores busy)"
