"""Worker failover, measured: the gap from a worker's SIGKILL to the next token its streams' clients receive.

A stack of its own (``bench/chaos``: two workers, one gateway, the synthetic engine at 20 tokens/s per stream, so
that the figure is the platform's and not a model's) carries streams of ``tokens`` tokens, ``concurrency`` at a
time; once the victim is generating some of them (its ``/state``), it is SIGKILLed, and its supervisor starts it
again before the next round, which kills the other worker. Per stream of the victim: the kill → next token gap.
Run with the worker lease on (``worker.liveness_ttl_s``, peers evict the dead worker) and off (the Kafka session
timeout of the chaos stack, 6 s, the broker's minimum, finds it), side by side. The load client runs in this process;
its CPU cost is small next to the gaps measured (seconds), which are wall-clock times of token arrivals.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from bench.chaos.client import Load, Stream
from bench.chaos.environment import ChaosEnv, Knobs, Ports
from bench.common import percentiles
from runtime.settings import Settings

Say = Callable[[str], None]


def gaps_after(streams: list[Stream], victims: set[str], killed_at: float) -> list[float]:
    """Kill → next content chunk, for each stream the victim was generating (those that got one)."""
    out = []
    for stream in streams:
        if stream.request_id in victims:
            after = [t for t in stream.chunk_times if t > killed_at]
            if after:
                out.append(after[0] - killed_at)
    return out


async def one_setting(settings: Settings, *, liveness_ttl_s: float, kills: int, concurrency: int, tokens: int,
                      port_base: int, say: Say) -> dict[str, Any]:
    env = ChaosEnv(settings, Ports(port_base), Knobs(liveness_ttl_s=liveness_ttl_s))
    gaps: list[float] = []
    rounds = []
    try:
        await env.start(workers=2)
        for k in range(kills):
            victim = env.workers[k % 2]
            load = Load(env.base_urls, env.api_key, settings.model.served_name, requests=concurrency,
                        concurrency=concurrency, max_tokens=tokens, label=f"failover-{k}")
            running = asyncio.ensure_future(load.run())
            jobs = await env.mid_generation(victim)
            killed_at = load.now()
            env.kill_service(victim)
            streams = await running
            found = gaps_after(streams, {str(j["request_id"]) for j in jobs}, killed_at)
            completed = sum(1 for s in streams if s.completed)
            rounds.append({"victim": k % 2, "streams_on_victim": len(jobs), "gaps_s": [round(g, 4) for g in found],
                           "completed": completed, "sent": len(streams)})
            gaps += found
            say(f"kill {k + 1}/{kills}: {len(found)} streams, gap max {max(found, default=0):.2f} s, "
                f"{completed}/{len(streams)} completed")
            await victim.wait(300)
    finally:
        await env.stop()
    return {"liveness_ttl_s": liveness_ttl_s, "session_timeout_ms": env.knobs.session_timeout_ms,
            "kills": kills, "gap_s": percentiles(gaps), "samples": len(gaps), "rounds": rounds}


async def run(settings: Settings, *, kills: int, baseline_kills: int, concurrency: int, tokens: int,
              port_base: int, say: Say) -> dict[str, Any]:
    say(f"lease on: {kills} kills")
    lease = await one_setting(settings, liveness_ttl_s=1.0, kills=kills, concurrency=concurrency, tokens=tokens,
                              port_base=port_base, say=say)
    say(f"lease off (session timeout only): {baseline_kills} kills")
    session = await one_setting(settings, liveness_ttl_s=0.0, kills=baseline_kills, concurrency=concurrency,
                                tokens=tokens, port_base=port_base, say=say)
    return {"engine": "synthetic", "tokens_per_s": Knobs().tokens_per_s, "concurrency": concurrency,
            "tokens": tokens, "lease": lease, "session_timeout_only": session}
