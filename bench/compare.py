"""Side by side: our pipeline vs vLLM's own server, same model, same engine arguments, same workload.

Both servers run at once (idle engines cost nothing) and take turns: each round runs the workload on one side, then
on the other, the order alternating between rounds, so drift on this noisy machine hits both. Every round sends
prompts neither engine has seen (both sides the same ones): with prefix caching on, a repeated prompt skips its
prefill, so only a first round would pay it and the rounds would not measure the same thing. Reported per
concurrency: the median over rounds of each figure, the ratio of output tokens/s (ours / vLLM) and the differences
of TTFT and ITL percentiles. Optionally vLLM's own benchmark client measures both sides too (the referee), in the
same rounds and order, on prompts of its own, with its medians over rounds compared the same way.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Generic, TypeVar

from bench.cpu import CpuMeter, nice_levels
from bench.loadgen import Run, Target, plan, run_load
from bench.servers import Side, infra_pids, our_side, vllm_side
from bench.stages import means_ms, scrape
from bench.workload import Shape, items
from ops.stack.manager import StackManager
from runtime.cpu_priority import renice
from runtime.settings import REPO_ROOT, Settings

Report = Callable[[str], None]
S = TypeVar("S")


#: what the referee reports of each run
REFEREE_KEYS = ("completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
                "output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms", "median_tpot_ms",
                "median_e2el_ms")
#: of those, the counts, which add up over the paired rounds (the rest are medians over them; ``failed`` adds up
#: over every round the referee ran)
_REFEREE_COUNTS = ("completed", "total_input_tokens", "total_output_tokens")


def round_shape(shape: Shape, concurrency: int, round_no: int, client: str) -> Shape:
    """One round's workload for one client: at least four requests per stream, and prompts no earlier round or
    other client sent (a seed of its own, 32 bits: the referee seeds NumPy with it), the same for both sides."""
    key = f"{shape.seed}/{concurrency}/{round_no}/{client}".encode()
    return replace(shape, requests=max(shape.requests, 4 * concurrency),
                   seed=int.from_bytes(hashlib.sha256(key).digest()[:4], "big"))


@dataclass(frozen=True)
class Slot(Generic[S]):
    """One round at one concurrency: the sides in the order they run, and what each client sends to both."""

    concurrency: int
    round_no: int
    order: tuple[S, ...]
    workload: Shape
    referee_workload: Shape


def schedule(sides: Sequence[S], concurrencies: list[int], rounds: int, shape: Shape) -> Iterator[Slot[S]]:
    """The rounds in the order they run: the sides' order alternating, so drift over a run hits both alike (an even
    number of rounds gives each side the first turn as often). A concurrency given twice runs once: its prompts
    would be the same again, cached."""
    for c in dict.fromkeys(concurrencies):
        for r in range(rounds):
            order = tuple(sides) if r % 2 == 0 else tuple(reversed(sides))
            yield Slot(c, r, order, round_shape(shape, c, r, "kns"), round_shape(shape, c, r, "referee"))


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def aggregate(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over rounds of the figures the comparison reports."""
    return {
        "rounds": len(summaries),
        "output_tokens_per_s": _median([s["output_tokens_per_s"] for s in summaries]),
        "request_throughput": _median([s["request_throughput"] for s in summaries]),
        "errors": sum(sum(s["errors"].values()) for s in summaries),
        "cpu_s_per_1k_output_tokens": cpu_per_1k_tokens(summaries),
        **({"stages_mean_ms": stage_means(summaries)} if any("stages_ms" in s for s in summaries) else {}),
        **{f"{metric}_{q}": _median([s[f"{metric}_s"][q] for s in summaries])
           for metric in ("ttft", "itl", "tpot", "e2e") for q in ("p50", "p99")},
    }


def cpu_per_1k_tokens(summaries: list[dict[str, Any]]) -> dict[str, float]:
    """Median CPU seconds per 1000 output tokens, per process, over rounds: where each side's time goes."""
    per_round = [{k: v * 1000 / s["output_tokens"] for k, v in s.get("cpu_s", {}).items()}
                 for s in summaries if s["output_tokens"]]
    keys = {k for r in per_round for k in r}
    return {k: round(statistics.median(r.get(k, 0.0) for r in per_round), 3)
            for k in sorted(keys) if any(r.get(k, 0.0) > 0.005 for r in per_round)}


def stage_means(summaries: list[dict[str, Any]]) -> dict[str, float]:
    """Median over rounds of each stage's mean (ms): where a request's time went between the services."""
    stages = {stage for s in summaries for stage in s.get("stages_ms", {})}
    return {stage: round(statistics.median(s["stages_ms"][stage]["mean_ms"] for s in summaries
                                           if stage in s.get("stages_ms", {})), 2)
            for stage in sorted(stages)}


def _side_by_side(ours: dict[str, Any], vllm: dict[str, Any], throughput: str, latencies: tuple[str, ...],
                  to_ms: float) -> dict[str, Any]:
    """Ours against vLLM's: the ratio of output tokens/s, and each latency's difference in ms."""
    a, b = ours.get(throughput), vllm.get(throughput)

    def diff_ms(key: str) -> float | None:
        x, y = ours.get(key), vllm.get(key)
        return None if x is None or y is None else round((x - y) * to_ms, 2)

    return {"output_tokens_per_s_ratio": round(a / b, 3) if a and b else None,
            **{f"{k}_diff_ms": diff_ms(k) for k in latencies}}


def ratios(ours: dict[str, Any], vllm: dict[str, Any]) -> dict[str, Any]:
    """Our client's medians (latencies in seconds)."""
    return _side_by_side(ours, vllm, "output_tokens_per_s", ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99"), 1000)


def referee_measured(run: dict[str, Any]) -> bool:
    """Whether a referee run measured anything: it ran, and completed requests (when every request fails, vLLM's
    client still exits 0 and reports its latencies as 0)."""
    return "error" not in run and bool(run.get("completed"))


def referee_aggregate(by_side: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """The referee's figures over the rounds both sides measured (paired, as the rounds are): counts summed, the
    rest medians; the rounds lost on each side, and requests failed in any round it ran, are counted."""
    paired = [i for i in range(min(map(len, by_side.values()), default=0))
              if all(referee_measured(runs[i]) for runs in by_side.values())]
    out: dict[str, dict[str, Any]] = {}
    for side, runs in by_side.items():
        kept = [runs[i] for i in paired]
        agg: dict[str, Any] = {"rounds": len(kept), "of_rounds": len(runs),
                               "failed_rounds": sum(not referee_measured(r) for r in runs)}
        for key in REFEREE_KEYS:
            if key == "failed":
                agg[key] = sum(r.get(key) or 0 for r in runs if "error" not in r)
            elif key in _REFEREE_COUNTS:
                agg[key] = sum(r.get(key) or 0 for r in kept)
            else:
                agg[key] = _median([r.get(key) for r in kept])
        out[side] = agg
    return out


def referee_ratios(ours: dict[str, Any], vllm: dict[str, Any]) -> dict[str, Any]:
    """The referee's medians (latencies in ms), compared as :func:`ratios` compares our client's."""
    return _side_by_side(ours, vllm, "output_throughput", ("median_ttft_ms", "p99_ttft_ms", "median_itl_ms",
                                                           "p99_itl_ms"), 1)


async def _warm(side: Side, model: str) -> None:
    run = plan(Target(side.base_url, model, side.api_key, label=side.label), Shape("fixed", 4, 32, 8), concurrency=2)
    await run_load(run)


def referee(side: Side, settings: Settings, concurrency: int, shape: Shape) -> dict[str, Any]:
    """vLLM's benchmark client against one side, on the very prompts and output lengths our generator sends (its
    ``custom`` dataset, chat template left to the server); its own figures."""
    with tempfile.TemporaryDirectory() as tmp:
        dataset = Path(tmp) / "prompts.jsonl"
        dataset.write_text("".join(json.dumps({"prompt": i.prompt, "output_tokens": i.max_tokens}) + "\n"
                                   for i in items(shape)))
        cmd = [sys.executable, "-m", "bench.referee", "--backend", "openai-chat", "--base-url",
               side.base_url.removesuffix("/v1"), "--endpoint", "/v1/chat/completions",
               "--model", settings.model.served_name, "--tokenizer", str(settings.model.path),
               "--dataset-name", "custom", "--dataset-path", str(dataset), "--skip-chat-template",
               "--custom-output-len", "-1", "--num-prompts", str(shape.requests),
               "--max-concurrency", str(concurrency), "--ignore-eos", "--seed", str(shape.seed), "--disable-tqdm",
               "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
               # its parser takes each event for one data line: our streams without their resume ids
               "--header", "kns-event-ids=off",
               "--save-result", "--result-dir", tmp, "--result-filename", "result.json"]
        env = {**os.environ, "OPENAI_API_KEY": side.api_key}
        try:
            done = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=1800)
            if done.returncode != 0:
                return {"error": f"exit {done.returncode}: {(done.stdout + done.stderr)[-2000:]}"}
            data = json.loads((Path(tmp) / "result.json").read_text())
        except subprocess.TimeoutExpired as exc:  # one lost round, not the whole run
            output = _text(exc.stdout)[-1000:] + _text(exc.stderr)[-1000:]
            return {"error": f"timed out after {exc.timeout:g} s: {output}"}
        except (OSError, ValueError) as exc:  # no result file, or not JSON
            return {"error": f"{type(exc).__name__}: {exc}"}
    if not isinstance(data, dict):
        return {"error": f"its result is not an object: {str(data)[:200]}"}
    return {k: data.get(k) for k in REFEREE_KEYS}


def _text(output: str | bytes | None) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


async def compare(settings: Settings, *, concurrencies: list[int], rounds: int, shape: Shape, with_referee: bool,
                  report: Report, gateway_port: int = 8010, worker_port: int = 8110, vllm_port: int = 8300,
                  vllm_server_nice: int = 0) -> tuple[dict[str, Any], list[Run]]:
    report("making sure Kafka, Cassandra and Redis are up")
    await StackManager(settings).up(app=False)
    ours = await our_side(settings, gateway_port, worker_port, namespace="bench-compare")
    theirs = vllm_side(settings, vllm_port)
    sides = [ours, theirs]
    procs = [p for side in sides for p in side.procs]
    infra = infra_pids(settings)
    runs: list[Run] = []
    try:
        report("starting vLLM's server and our worker + gateway (same engine arguments)")
        # One side at a time: an engine sizes its KV cache from the accelerator memory it sees free while it
        # starts, and another engine loading beside it would skew that.
        for side in sides:
            for proc in side.procs:
                proc.start()
            await asyncio.gather(*(proc.wait() for proc in side.procs))
        if vllm_server_nice and (pid := theirs.procs[0].pid):
            renice(pid, vllm_server_nice)  # its API server's threads; the engine's processes keep theirs
        nice = nice_levels({**{p.name: p.pid for p in procs if p.pid}, **infra})
        for side in sides:
            await _warm(side, settings.model.served_name)
        per: dict[int, dict[str, list[dict[str, Any]]]] = {}
        refereed: dict[int, dict[str, list[dict[str, Any]]]] = {}
        for slot in schedule(sides, concurrencies, rounds, shape):
            c, n = slot.concurrency, f"round {slot.round_no + 1}/{rounds}"
            for side in slot.order:
                report(f"concurrency {c}, {n}: {side.label}")
                run = plan(Target(side.base_url, settings.model.served_name, side.api_key, label=side.label),
                           slot.workload, concurrency=c)
                meter = CpuMeter({**{p.name: p.pid for p in side.procs if p.pid}, **infra})
                stages_before = await scrape(side.metrics_urls) if side.metrics_urls else None
                await run_load(run)
                runs.append(run)
                summary = run.summary()
                summary["cpu_s"] = meter.since()
                if stages_before is not None:
                    summary["stages_ms"] = means_ms(stages_before, await scrape(side.metrics_urls))
                per.setdefault(c, {s.label: [] for s in sides})[side.label].append(summary)
            for side in slot.order if with_referee else ():
                report(f"concurrency {c}, {n}: {side.label}, the referee (vllm bench serve)")
                result = await asyncio.to_thread(referee, side, settings, c, slot.referee_workload)
                refereed.setdefault(c, {s.label: [] for s in sides})[side.label].append(result)
        results: dict[str, Any] = {"shape": shape.__dict__, "sides": {s.label: s.description for s in sides},
                                   "nice_levels": nice, "concurrency": {}}
        for c, by_side in per.items():
            agg = {label: aggregate(summaries) for label, summaries in by_side.items()}
            results["concurrency"][str(c)] = {**agg, "ours_vs_vllm": ratios(agg["ours"], agg["vllm"]),
                                              "rounds": by_side}
        if with_referee:
            results["referee"] = {}
            for c, by_side in refereed.items():
                agg = referee_aggregate(by_side)
                results["referee"][str(c)] = {**agg, "ours_vs_vllm": referee_ratios(agg["ours"], agg["vllm"]),
                                              "rounds": by_side}
        return results, runs
    finally:
        for proc in procs:
            proc.stop()
