"""``kns bench``: the platform's benchmarks. Results go to ``bench/results/*.json``."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from bench.common import save, stop_cleanly_on_sigterm
from runtime.cli_tables import show
from runtime.settings import load_settings

app = typer.Typer(help="Benchmarks (JSON results in bench/results/).", no_args_is_help=True)
console = Console()
#: under --json the result file's JSON is all there is on stdout; what a benchmark says meanwhile goes here
err = Console(stderr=True)
JSON = typer.Option(False, "--json", help="Print the result (the JSON saved in bench/results) on stdout instead of "
                    "tables; progress goes to stderr.")


def _out(as_json: bool) -> Console:
    return err if as_json else console


def _say(out: Console, suffix: str = "") -> Any:
    return lambda message: out.print(f"[dim]•[/dim] {message}{suffix}")


def _saved(out: Console, as_json: bool, path: Path, *also: Path) -> None:
    if as_json:
        typer.echo(path.read_text(), nl=False)
    out.print(f"[green]saved[/green] {' and '.join(str(p) for p in (path, *also))}")


@app.callback()
def _bench() -> None:
    stop_cleanly_on_sigterm()


@app.command("billing")
def billing(events: int = typer.Option(100_000, min=1000, help="Usage events to produce."),
            as_json: bool = JSON) -> None:
    """Export and reconcile on a usage topic of N events (own namespace and keyspace, removed after)."""
    from bench.billing_replay import run

    out = _out(as_json)
    result = asyncio.run(run(load_settings(), events, _say(out)))
    if not as_json:
        show(out, billing_table(result))
        out.print(f"export parquet {result['export_seconds']['parquet']:.2f} s, csv "
                  f"{result['export_seconds']['csv']:.2f} s; discrepancies {result['discrepancies']}")
    _saved(out, as_json, save("billing-replay", result))


def billing_table(result: dict[str, Any]) -> Table:
    table = Table(title=f"billing replay: {result['events']} usage events")
    table.add_column("step")
    table.add_column("seconds", justify="right")
    for step, seconds in result["seconds"].items():
        table.add_row(step, f"{seconds:.2f}")
    return table


@app.command("safety")
def safety(
    requests: int = typer.Option(200, min=1), concurrency: int = typer.Option(4, min=1),
    streams: int = typer.Option(10, min=1), as_json: bool = JSON,
    long: bool = typer.Option(False, "--long", help="Benign requests with a system message and about 2,500 "
                              "characters of prose before the question (new to the pre-filter each time)."),
) -> None:
    """Pre-filter latency (submitted → admitted) and post-filter slip, on the running stack."""
    from bench.safety_latency import run

    out = _out(as_json)
    settings = load_settings()
    result = asyncio.run(run(settings, requests, concurrency, streams, long=long))
    pre, post = result["prefilter"]["added_latency_s"], result["postfilter"]
    out.print(f"pre-filter added latency over {result['prefilter']['requests']} requests: "
              f"p50 {pre['p50'] * 1000:.1f} ms, p99 {pre['p99'] * 1000:.1f} ms")
    out.print(f"post-filter: {post['halted']}/{len(post['streams'])} streams halted; decided at token "
              f"p50 {post['decided_at_token']['p50']}, slip p50 {post['slip_tokens']['p50']} "
              f"max {max((s['slip_tokens'] or 0) for s in post['streams'])} tokens")
    _saved(out, as_json, save("safety", result))


def _summary_table(title: str, summaries: list[dict[str, Any]]) -> Table:
    table = Table(title=title)
    for column in ("target", "conc.", "done", "errors", "req/s", "out tok/s", "TTFT p50", "TTFT p99", "ITL p50",
                   "ITL p99", "TPOT p50", "E2E p50"):
        table.add_column(column, justify="left" if column == "target" else "right")

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1000:.1f}"

    for s in summaries:
        table.add_row(s["label"] or s["base_url"], str(s["concurrency"] or f"{s['rate']}/s"), str(s["completed"]),
                      str(sum(s["errors"].values()) or "-"), f"{s['request_throughput'] or 0:.2f}",
                      f"{s['output_tokens_per_s'] or 0:.1f}", ms(s["ttft_s"]["p50"]), ms(s["ttft_s"]["p99"]),
                      ms(s["itl_s"]["p50"]), ms(s["itl_s"]["p99"]), ms(s["tpot_s"]["p50"]), ms(s["e2e_s"]["p50"]))
    return table


@app.command("load")
def load(
    base_url: str | None = typer.Option(None, help="OpenAI-compatible base URL (default: this stack's gateway)."),
    model: str | None = typer.Option(None, help="Model name (default: the served model)."),
    api_key: str | None = typer.Option(None, envvar="OPENAI_API_KEY", help="Default: .local/dev-api-key."),
    concurrency: int | None = typer.Option(None, help="Requests in flight at once."),
    rate: float | None = typer.Option(None, help="Poisson arrivals, requests per second."),
    requests: int = typer.Option(64, help="How many requests."),
    dataset: str = typer.Option("sharegpt", help="sharegpt (log-normal lengths) or fixed."),
    input_len: int = typer.Option(128, help="Prompt length in words (median for sharegpt)."),
    output_len: int = typer.Option(128, help="Output tokens (median for sharegpt)."),
    seed: int = typer.Option(0),
    ignore_eos: bool = typer.Option(True, help="Generate exactly max_tokens (servers that support it)."),
    label: str = typer.Option("", help="Name of the target in tables and plots."),
    as_json: bool = JSON,
) -> None:
    """Stream chat completions against a server and measure TTFT, ITL, TPOT, E2E and throughput."""
    from bench.loadgen import Target, plan, run_load
    from bench.plot import plot_runs
    from bench.workload import Shape, WorkloadError

    settings = load_settings()
    if dataset not in ("sharegpt", "fixed"):
        raise typer.BadParameter("--dataset must be sharegpt or fixed")
    key = api_key
    if key is None and base_url is None:
        from ops.chat_cli import read_dev_key

        key = read_dev_key(settings.stack.dev_key_file)
    target = Target(base_url or f"http://{settings.gateway.host}:{settings.gateway.port}/v1",
                    model or settings.model.served_name, key or "none", ignore_eos, label)
    shape = Shape(dataset, requests, input_len, output_len, seed, settings.model.max_model_len)  # type: ignore[arg-type]
    try:
        run = plan(target, shape, concurrency=concurrency, rate=rate)
    except WorkloadError as exc:
        raise typer.BadParameter(str(exc)) from exc
    out = _out(as_json)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=out) as bar:
        task = bar.add_task(label or target.base_url, total=requests)
        try:
            asyncio.run(run_load(run, progress=lambda done: bar.update(task, completed=done)))
        except KeyboardInterrupt:
            run.interrupted = True
            out.print("[yellow]interrupted: keeping what was measured[/yellow]")
    summary = run.summary()
    if not as_json:
        show(out, _summary_table("load", [summary]))
    for status, count in summary["errors"].items():
        out.print(f"[red]{count} requests failed with status {status}[/red]; e.g. "
                  f"{next(r.error for r in run.results if not r.ok and str(r.status or 'connection') == status)}")
    path = save("load", run.as_json())
    png = plot_runs([run], path.with_suffix(".png"), f"load: {target.base_url}")
    _saved(out, as_json, path, png)
    if run.interrupted:
        raise typer.Exit(130)  # what was measured is kept, but the run did not finish: never a success


@app.command("compare")
def compare_command(
    concurrency: list[int] = typer.Option([1, 8], "--concurrency", "-c", help="Repeat for several levels."),
    rounds: int = typer.Option(4, min=1, help="A/B rounds per concurrency (medians are reported)."),
    requests: int = typer.Option(16, min=2, help="Requests per round (at least 4 x concurrency)."),
    input_len: int = typer.Option(128, help="Prompt words."),
    output_len: int = typer.Option(64, help="Output tokens (ignore_eos on both sides)."),
    referee: bool = typer.Option(True, help="Also run vLLM's own `vllm bench serve` against both, in every "
                                 "round, on prompts of its own."),
    vllm_server_nice: int = typer.Option(0, min=0, max=19, help="Renice vLLM's API server process (not its "
                                         "engine) to this level, as ours yield (cpu.yield_nice): a control."),
    as_json: bool = JSON,
) -> None:
    """Our full pipeline vs vLLM's own OpenAI server: same model, same engine arguments, alternating rounds."""
    from bench.compare import compare
    from bench.plot import plot_runs
    from bench.workload import Shape, WorkloadError
    from ops.stack.manager import StackManager

    out = _out(as_json)
    settings = load_settings()
    busy = [s.name for s in asyncio.run(StackManager(settings).status()) if s.pid and not s.name.startswith(
        ("kafka", "cassandra", "redis"))]
    if busy:
        out.print(f"[yellow]note:[/yellow] {', '.join(busy)} of the dev stack are running; idle, they cost "
                  "little, but for quiet figures stop them (kns stack down -s worker ...).")
    if rounds % 2:
        out.print(f"[yellow]note:[/yellow] with {rounds} rounds one side goes first once more than the other; "
                  "an even number gives both the first turn as often.")
    shape = Shape("fixed", requests, input_len, output_len, 0, settings.model.max_model_len)
    try:
        shape.validate()
    except WorkloadError as exc:
        raise typer.BadParameter(str(exc)) from exc
    results, runs = asyncio.run(compare(settings, concurrencies=concurrency, rounds=rounds, shape=shape,
                                        with_referee=referee, vllm_server_nice=vllm_server_nice,
                                        report=_say(out)))
    if not as_json:
        show_comparison(results, out)
    path = save("compare", results)
    png = plot_runs(runs, path.with_suffix(".png"), "ours vs vLLM's server (all rounds)")
    _saved(out, as_json, path, png)


def show_comparison(results: dict[str, Any], out: Console = console) -> None:
    from bench.compare import referee_measured

    for label, description in results["sides"].items():
        out.print(f"[bold]{label}[/bold]: {description}")
    show(out, comparison_table(results))
    for table in cpu_tables(results):
        show(out, table)
    if "referee" in results:
        for c, data in results["referee"].items():
            for side, rounds_ in data["rounds"].items():
                for run in rounds_:
                    if not referee_measured(run):
                        why = (str(run["error"]) if "error" in run
                               else f"no request completed ({run.get('failed')} failed)")
                        out.print(f"[red]a referee round failed on {side} (c={c}):[/red] {why[-300:]}")
        show(out, referee_table(results))


def comparison_table(results: dict[str, Any]) -> Table:
    table = Table(title="ours vs vLLM (medians over rounds)")
    for column in ("conc.", "side", "out tok/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "errors"):
        table.add_column(column, justify="right")

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1000:.1f}"

    for c, data in results["concurrency"].items():
        for side in ("ours", "vllm"):
            a = data[side]
            table.add_row(c, side, f"{a['output_tokens_per_s']:.1f}", ms(a["ttft_p50"]), ms(a["ttft_p99"]),
                          ms(a["itl_p50"]), ms(a["itl_p99"]), str(a["errors"]))
        r = data["ours_vs_vllm"]
        diffs = [f"{r[k]:+.1f}" for k in ("ttft_p50_diff_ms", "ttft_p99_diff_ms", "itl_p50_diff_ms", "itl_p99_diff_ms")]
        table.add_row(c, "ours/vLLM", f"{r['output_tokens_per_s_ratio']}x", *diffs, "")
    return table


def cpu_tables(results: dict[str, Any]) -> list[Table]:
    tables = []
    for c, data in results["concurrency"].items():
        cpu = Table(title=f"where the time goes, concurrency {c}: CPU seconds per 1000 output tokens (median)")
        cpu.add_column("process")
        cpu.add_column("ours", justify="right")
        cpu.add_column("vllm", justify="right")
        ours, theirs = (data[s].get("cpu_s_per_1k_output_tokens", {}) for s in ("ours", "vllm"))
        for name in sorted(ours.keys() | theirs.keys(), key=lambda n: -(ours.get(n, 0) + theirs.get(n, 0))):
            cells = [f"{side[name]:.2f}" if name in side else "" for side in (ours, theirs)]
            cpu.add_row(name, *cells)
        cpu.add_row("total", f"{sum(ours.values()):.2f}", f"{sum(theirs.values()):.2f}")
        if ours or theirs:
            tables.append(cpu)
    return tables


def referee_table(results: dict[str, Any]) -> Table:
    ref = Table(title="referee: vllm bench serve (its own figures, medians over rounds)")
    for column in ("conc.", "side", "out tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms",
                   "failed"):
        ref.add_column(column, justify="right")

    def num(value: float | None, fmt: str = ".1f") -> str:
        return "-" if value is None else format(value, fmt)

    for c, data in results["referee"].items():
        for side in ("ours", "vllm"):
            a = data[side]
            failed = f"{a['failed']}" + (f", rounds lost: {a['failed_rounds']}" if a["failed_rounds"] else "")
            if a["rounds"] < a["of_rounds"]:
                failed += f" (medians of {a['rounds']}/{a['of_rounds']} rounds)"
            ref.add_row(c, side, num(a["output_throughput"]), num(a["median_ttft_ms"]), num(a["p99_ttft_ms"]),
                        num(a["median_itl_ms"]), num(a["p99_itl_ms"]), failed)
        r = data["ours_vs_vllm"]
        ratio = "-" if r["output_tokens_per_s_ratio"] is None else f"{r['output_tokens_per_s_ratio']}x"
        ref.add_row(c, "ours/vLLM", ratio, *(num(r[f"{k}_diff_ms"], "+.1f") for k in (
            "median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms")), "")
    return ref


@app.command("kafka-hop")
def kafka_hop(
    wait: list[int] = typer.Option([5, 100, 500], "--fetch-max-wait-ms", help="Consumer fetch waits to compare."),
    records: int = typer.Option(500, min=10), gap_ms: float = typer.Option(20.0, help="Pause between records."),
    as_json: bool = JSON,
) -> None:
    """Kafka produce → consume latency on this machine, per consumer fetch wait, the consumer in the producer's
    process and in its own (as the pipeline's hops), with the clients' CPU."""
    from bench.kafka_hop import run

    out = _out(as_json)
    results = asyncio.run(run(load_settings().kafka, wait, records, gap_ms / 1000))
    if not as_json:
        show(out, kafka_hop_table(results, f"Kafka hop, {records} records, one every {gap_ms:g} ms"))
    _saved(out, as_json, save("kafka-hop", {"results": results}))


def kafka_hop_table(results: list[dict[str, Any]], title: str) -> Table:
    table = Table(title=title)
    for column in ("fetch_max_wait_ms", "consumer", "p50 ms", "p90 ms", "p99 ms", "client CPU (cores)"):
        table.add_column(column, justify="right")
    for r in results:
        h = r["hop_s"]
        table.add_row(str(r["fetch_max_wait_ms"]), r["consumer"], f"{h['p50'] * 1000:.2f}", f"{h['p90'] * 1000:.2f}",
                      f"{h['p99'] * 1000:.2f}", f"{r['client_cpu_share_of_one_core']:.3f}")
    return table


@app.command("relay")
def relay(
    events: int = typer.Option(200_000, help="A: token events in the backlog."),
    requests: int = typer.Option(1000, help="A: requests they belong to."),
    level: list[int] = typer.Option([50, 100, 200, 400, 800, 1600], "--streams", help="B: concurrent streams."),
    tokens: int = typer.Option(40, help="B: tokens per stream."),
    rate: float = typer.Option(20.0, help="B: tokens per second per stream (synthetic engine)."),
    ttft_limit_ms: float = typer.Option(1000.0), itl_limit_ms: float = typer.Option(250.0),
    skip_streams: bool = typer.Option(False, help="Only part A."),
    record_versions: str = typer.Option("3", help="B: the worker's token record versions to run, one after the "
                                        "other (2: one record per request per step, 3: one per step)."),
    gateway_processes: int = typer.Option(1, help="B, C: the gateway's processes (kns gateway --processes)."),
    pin: bool = typer.Option(True, help="B, C: the gateway on a core of its own, the load on the others."),
    streams_ramp_s: float = typer.Option(0.0, help="B: each level's streams start evenly over this long (0: at "
                                         "once)."),
    source: str = typer.Option("worker", help="B: what writes the token records: worker (synthetic engine) or "
                               "tokens (bench.token_source: the same records at a fraction of the load's CPU)."),
    held: int = typer.Option(0, help="C: idle-heavy streams held open at once (0: no part C)."),
    held_tokens: int = typer.Option(60, help="C: tokens per held stream."),
    held_rate: float = typer.Option(1.0, help="C: tokens per second per held stream."),
    ramp_s: float = typer.Option(60.0, help="C: the held streams start evenly over this long."),
    held_workers: int = typer.Option(1, help="C: synthetic workers (each an engine stepping on a phase of its own, "
                                             "as a fleet's engines do)."),
    as_json: bool = JSON,
) -> None:
    """Relay capacity: A. demultiplexer events/s; B. concurrent SSE streams before TTFT/ITL p99 degrade;
    C. idle-heavy streams held open at once."""
    from bench.relay import Placement, demux_capacity, stream_capacity

    out = _out(as_json)
    settings = load_settings()
    placement = Placement.split() if pin else Placement()
    level = [n for n in level if n > 0]  # --streams 0: no part B
    out.print(f"[dim]placement: {placement.describe()}; token records from: {source}[/dim]")
    packed = asyncio.run(demux_capacity(settings, events, requests, per_record=256))
    single = asyncio.run(demux_capacity(settings, events, requests, per_record=1))
    result: dict[str, Any] = {"demux": packed, "demux_one_per_record": single}
    for d in (single, packed):
        out.print(f"A. one relay demultiplexes {d['events_per_s']:,} token events/s "
                  f"({d['events']:,} events of {d['requests']} requests, {d['deltas_per_record']} per record, "
                  f"{d['seconds']:.2f} s)")
    if not skip_streams:
        import uvloop  # the clients' event loop is part of what is measured: the fast one

        runs = [uvloop.run(stream_capacity(settings, level, tokens, rate, ttft_limit_ms / 1000, itl_limit_ms / 1000,
                                           _say(out), record_version=int(v),
                                           gateway_processes=gateway_processes, placement=placement,
                                           ramp_s=streams_ramp_s, source=source))
                for v in record_versions.split(",")] if level else []
        if held:
            runs.append(uvloop.run(stream_capacity(
                settings, [held], held_tokens, held_rate, ttft_limit_ms / 1000, 2 / held_rate,
                _say(out, f" (idle-heavy, started over {ramp_s:g} s)"),
                ramp_s=ramp_s, gateway_processes=gateway_processes, placement=placement, workers=held_workers)))
            result["held"] = runs[-1]
        result["stream_runs"] = runs
        if not as_json:
            show(out, relay_table(runs, gateway_processes))
            for run_ in runs:
                for lv in run_["levels"]:
                    busy = ", ".join(f"{k} {v:.2f}" for k, v in sorted(lv["cpu_cores"].items(), key=lambda kv: -kv[1]))
                    out.print(f"  v{run_['record_version']} {lv['streams']} streams, CPU cores busy: {busy}")
                    stages = "; ".join(f"{name} p50 ≤ {st['p50_le'] * 1000:g} ms, p99 ≤ {st['p99_le'] * 1000:g} ms"
                                       for name, st in lv.get("stages", {}).items())
                    out.print(f"    [dim]{stages}[/dim]")
                    tenths = ", ".join("-" if t is None else f"{t * 1000:.0f}"
                                       for t in lv.get("ttft_p99_s_by_tenth", []))
                    out.print(f"    [dim]TTFT p99 (ms) of each tenth of the streams, in start order: {tenths}[/dim]")
    _saved(out, as_json, save("relay", result))


def relay_table(runs: list[dict[str, Any]], gateway_processes: int) -> Table:
    table = Table(title=f"SSE streams through {gateway_processes} gateway process(es)")
    for column in ("records", "streams", "tok/s each", "done", "relayed events/s", "gateway cores",
                   "gateway µs/event", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "ok"):
        table.add_column(column, justify="right")
    for run_ in runs:
        for lv in run_["levels"]:
            table.add_row(f"v{run_['record_version']}", str(lv["streams"]), f"{run_['tokens_per_s_per_stream']:g}",
                          str(lv["completed"]), str(lv["relayed_events_per_s"]), str(lv["gateway_cores_busy"]),
                          str(lv["gateway_us_per_event"]),
                          *(f"{lv[m][q] * 1000:.0f}" if lv[m][q] is not None else "-"
                            for m in ("ttft_s", "itl_s") for q in ("p50", "p99")),
                          "yes" if lv["ok"] else "[red]no[/red]")
    return table


@app.command("limiter")
def limiter(
    requests: int = typer.Option(2000, min=100, help="Sequential calls of each step (latency)."),
    tasks: int = typer.Option(64, min=1, help="Tasks calling at once (admissions per second)."),
    seconds: float = typer.Option(8.0, min=1, help="Length of each throughput run."),
    concurrency: int = typer.Option(64, min=1, help="HTTP clients at once against one gateway."),
    as_json: bool = JSON,
) -> None:
    """What the key check and the rate limiter add per request, and what one gateway process admits per second."""
    from bench.limiter import run

    out = _out(as_json)
    result = asyncio.run(run(load_settings(), requests=requests, tasks=tasks, seconds=seconds,
                             concurrency=concurrency, say=_say(out)))
    if not as_json:
        for table in limiter_tables(result):
            show(out, table)
    _saved(out, as_json, save("limiter", result))


def limiter_tables(result: dict[str, Any]) -> list[Table]:
    table = Table(title="key check and limiter, in one process (real Redis)")
    for column in ("step", "p50 ms", "p99 ms", "per second (one process)"):
        table.add_column(column, justify="right" if column != "step" else "left")
    rates = result["in_process"]["per_second_one_process"]
    for step, latency in result["in_process"]["latency_s"].items():
        table.add_row(step, f"{latency['p50'] * 1000:.3f}", f"{latency['p99'] * 1000:.3f}",
                      str(rates.get(step, "")))
    http = Table(title="one gateway process over HTTP (synthetic engine)")
    for column in ("requests", "per second", "p50 ms", "p99 ms", "statuses", "CPU s (gateway / worker / client)"):
        http.add_column(column, overflow="fold" if column == "statuses" else "ellipsis")
    for name, row in result["http"].items():
        cpu = row["cpu_s"]
        http.add_row(name, str(row["per_second"]), f"{row['latency_s']['p50'] * 1000:.1f}",
                     f"{row['latency_s']['p99'] * 1000:.1f}", str(row["statuses"]),
                     f"{cpu.get('gateway', 0):.1f} / {sum(v for k, v in cpu.items() if k.startswith('worker')):.1f}"
                     f" / {cpu.get('load client', 0):.1f}")
    return [table, http]


@app.command("priority")
def priority(
    slots: int = typer.Option(8, min=1, help="Requests the (synthetic) engine runs at once."),
    backlog: int = typer.Option(64, min=1, help="Free-tier requests sent at once."),
    urgent: int = typer.Option(12, min=1, help="Enterprise requests sent one every 0.5 s during the backlog."),
    as_json: bool = JSON,
) -> None:
    """Priority classes under saturation: the queue wait of enterprise and free requests, gate on and off."""
    from bench.priority import run

    out = _out(as_json)
    result = asyncio.run(run(load_settings(), slots=slots, backlog=backlog, urgent=urgent, say=_say(out)))
    if not as_json:
        show(out, priority_table(result))
    _saved(out, as_json, save("priority", result))


def priority_table(result: dict[str, Any]) -> Table:
    shape = result["shape"]
    table = Table(title=f"queue wait under saturation ({shape['slots']} slots, {shape['backlog']} free queued, "
                        f"{shape['urgent']} enterprise)")
    for column in ("gate", "class", "completed", "TTFT p50 s", "TTFT p99 s"):
        table.add_column(column)
    for run_ in result["runs"]:
        for name in ("enterprise", "free"):
            row = run_[name]
            table.add_row("on" if run_["gate"] else "off", name, f"{row['completed']}/{row['sent']}",
                          f"{row['ttft_s']['p50']:.2f}", f"{row['ttft_s']['p99']:.2f}")
    return table


@app.command("failover")
def failover(
    kills: int = typer.Option(20, min=1, help="SIGKILLs with the worker lease on."),
    baseline_kills: int = typer.Option(5, min=0, help="SIGKILLs with the lease off (session timeout only)."),
    concurrency: int = typer.Option(8, min=2, help="Streams at once."),
    tokens: int = typer.Option(120, min=20, help="Tokens per stream."),
    port_base: int = typer.Option(17700, help="First port of the bench stack's services."),
    as_json: bool = JSON,
) -> None:
    """Worker failover: the gap from a worker's SIGKILL to its streams' next token, lease on vs off."""
    from bench.failover import run

    out = _out(as_json)
    settings = load_settings()
    result = asyncio.run(run(settings, kills=kills, baseline_kills=baseline_kills, concurrency=concurrency,
                             tokens=tokens, port_base=port_base, say=_say(out)))
    if not as_json:
        show(out, failover_table(result))
    _saved(out, as_json, save("failover", result))


def failover_table(result: dict[str, Any]) -> Table:
    table = Table(title="worker failover: SIGKILL → next token")
    for column in ("detection", "kills", "streams", "gap p50", "gap p99", "gap max"):
        table.add_column(column, justify="right")
    for label, part in (("worker lease 1 s", result["lease"]),
                        (f"session timeout {result['session_timeout_only']['session_timeout_ms']} ms",
                         result["session_timeout_only"])):
        gap = part["gap_s"]
        cell = (lambda v: "-" if v is None else f"{v:.2f} s")  # noqa: E731
        table.add_row(label, str(part["kills"]), str(part["samples"]), cell(gap["p50"]), cell(gap["p99"]),
                      cell(max((g for r in part["rounds"] for g in r["gaps_s"]), default=None)))
    return table


@app.command("transport")
def transport(
    levels: str = typer.Option("1,8,64,256", help="Concurrencies, synthetic engine."),
    vllm_levels: str = typer.Option("1,8", help="Concurrencies with the real engine (empty: none)."),
    rounds: int = typer.Option(2, min=1, help="Waves of streams per concurrency."),
    tokens: int = typer.Option(64, min=2, help="Tokens per stream."),
    port_base: int = typer.Option(17800, help="First port of the bench stack's services."),
    as_json: bool = JSON,
) -> None:
    """Kafka records and bytes per generated token: one record per delta (v2) vs one per engine step (v3)."""
    from bench.transport import run

    def parse(text: str) -> list[int]:
        return [int(v) for v in text.split(",") if v.strip()]

    out = _out(as_json)
    result = asyncio.run(run(load_settings(), levels=parse(levels), vllm_levels=parse(vllm_levels), rounds=rounds,
                             tokens=tokens, port_base=port_base, say=_say(out)))
    if not as_json:
        show(out, transport_table(result))
    _saved(out, as_json, save("transport", result))


def transport_table(result: dict[str, Any]) -> Table:
    table = Table(title=f"token transport ({result['tokens_per_stream']} tokens per stream, {result['rounds']} waves)")
    for column in ("engine", "c", "records", "records/token v2", "records/token v3", "bytes/token v2",
                   "bytes/token v3", "deltas/record v3", "completed"):
        table.add_column(column, justify="right")
    by_key = {(r["engine"], r["concurrency"], r["version"]): r for r in result["rows"]}
    for (engine, c, version), row in by_key.items():
        if version != 3:
            continue
        old = by_key.get((engine, c, 2), {})
        table.add_row(engine, str(c), f"{old.get('records', '-')} → {row['records']}",
                      str(old.get("records_per_token", "-")), str(row["records_per_token"]),
                      str(old.get("bytes_per_token", "-")), str(row["bytes_per_token"]), str(row["deltas_per_record"]),
                      f"{row['completed']}/{row['streams']}")
    return table


@app.command("capacity")
def capacity(
    write: str | None = typer.Option(None, help="Rewrite the measured section of this Markdown file "
                                     "(docs/CAPACITY.md) between its capacity markers."),
    as_json: bool = JSON,
) -> None:
    """The capacity model: fleet sizes for the seeds' peak and a 10x smaller load, from the newest relay and
    transport results in bench/results and the assumptions in bench/capacity.py."""
    from bench.capacity import markdown, report, write_into

    out = _out(as_json)
    result = report()
    m = result["measured"]
    out.print(f"gateway: {m['gateway_s_per_request'] * 1e3:.2f} ms/request + "
              f"{m['gateway_s_per_event'] * 1e6:.1f} µs/event; {m['streams_per_gateway']:,} streams/process; "
              f"Kafka {m['records_per_token']:.3f} records and {m['bytes_per_token']:.0f} bytes per token")
    if not as_json:
        show(out, capacity_table(result))
    if write:
        write_into(Path(write), markdown(result))
        out.print(f"[green]wrote[/green] {write}")
    _saved(out, as_json, save("capacity", result))


def capacity_table(result: dict[str, Any]) -> Table:
    table = Table(title="capacity plan")
    for column in ("load", "model", "streams", "gateway procs", "brokers", "token partitions", "Cassandra",
                   "Redis", "GPUs"):
        table.add_column(column, justify="right")
    for p in result["plans"]:
        table.add_row(p["load"], f"{p['gpu']['model']} TP{p['gpu']['tp']}", f"{p['concurrent_streams']:,}",
                      f"{p['gateway']['processes']:,} ({p['gateway']['bound_by']})", str(p["kafka"]["brokers"]),
                      f"{p['kafka']['token_partitions']:,}", str(p["cassandra_nodes"]), str(p["redis_shards"]),
                      f"{p['gpu']['gpus']:,}")
    return table


@app.command("scale")
def scale(
    workers: str = typer.Option("1,2,4", help="Synthetic-engine workers to run, one setup after the other."),
    gateways: str = typer.Option("1,2,4", help="Gateway processes (kns gateway --processes)."),
    streams: int = typer.Option(256, help="Concurrent streams (a client process of their own)."),
    tokens: int = typer.Option(100, help="Tokens per stream."),
    rate: float = typer.Option(50.0, help="Tokens per second per sequence (synthetic engine)."),
    max_seqs: int = typer.Option(32, help="Sequences one worker runs at once."),
    as_json: bool = JSON,
) -> None:
    """Horizontal scaling on one box: delivered tokens/s for workers x gateway processes, and what saturates."""
    import uvloop

    from bench.scale import run

    def parse(text: str) -> list[int]:
        return [int(v) for v in text.split(",") if v.strip()]

    out = _out(as_json)
    result = uvloop.run(run(load_settings(), workers=parse(workers), gateways=parse(gateways), streams=streams,
                            tokens=tokens, rate=rate, max_seqs=max_seqs, say=_say(out)))
    if not as_json:
        show(out, scale_table(result))
    _saved(out, as_json, save("scale", result))


def scale_table(result: dict[str, Any]) -> Table:
    table = Table(title=f"{result['streams']} streams x {result['tokens_per_stream']} tokens at "
                        f"{result['tokens_per_s_per_stream']:g}/s, {result['max_seqs_per_worker']} sequences per "
                        f"worker, {result['cores']} cores")
    for column in ("workers", "gateway procs", "done", "delivered tok/s", "engines' tok/s", "share",
                   "busiest worker", "TTFT p50", "CPU busy (cores)", "saturated"):
        table.add_column(column, justify="right", overflow="fold" if column in ("CPU busy (cores)", "saturated")
                         else "ellipsis")
    for row in result["rows"]:
        busy = ", ".join(f"{k} {v:.2f}" for k, v in sorted(row["cpu_cores"].items(), key=lambda kv: -kv[1])[:4])
        ttft = row["ttft_s"]["p50"]
        table.add_row(str(row["workers"]), str(row["gateway_processes"]), str(row["completed"]),
                      f"{row['delivered_tok_s']:,}", f"{row['engines_tok_s']:,.0f}", str(row["of_engines"]),
                      f"{row['busiest_worker_load']}x",
                      f"{ttft * 1000:.0f}" if ttft is not None else "-", f"{row['cpu_total']} ({busy})",
                      row["saturated"])
    return table


@app.command("affinity")
def affinity(
    conversations: int = typer.Option(4, min=1, help="Conversations per setup (their turns run one at a time)."),
    turns: int = typer.Option(10, min=2, help="Turns per conversation."),
    output_tokens: int = typer.Option(16, min=1, help="max_output_tokens of each turn."),
    as_json: bool = JSON,
) -> None:
    """Prefix-cache affinity: cached prompt tokens and TTFT of multi-turn conversations on two workers, with the
    turns of a conversation keyed by it (one worker) and without."""
    from bench.affinity import run

    out = _out(as_json)
    result = asyncio.run(run(load_settings(), conversations=conversations, turns=turns,
                             output_tokens=output_tokens, say=_say(out)))
    if not as_json:
        show(out, affinity_table(result))
        for label in ("affinity", "none"):
            setup = result["setups"][label]
            out.print(f"{label}: cached share of prompt tokens (turns 2+) {setup['cached_share_turns_2_on']}, "
                      f"TTFT p50 {setup['ttft_s_p50_turns_2_on']} s, errors {setup['errors']}")
        out.print(f"TTFT p50 without affinity / with: {result['ttft_p50_ratio_none_over_affinity']}x")
    _saved(out, as_json, save("affinity", result))


def affinity_table(result: dict[str, Any]) -> Table:
    table = Table(title=f"{result['conversations']} conversations x {result['turns']} turns on 2 workers: "
                        "engine-reported cached prompt tokens (median) and TTFT (median, client-side)")
    table.add_column("turn", justify="right")
    for label in ("affinity", "none"):
        table.add_column(f"{label}: cached / prompt", justify="right")
        table.add_column(f"{label}: TTFT ms", justify="right")
    setups = result["setups"]
    for turn in setups["affinity"]["by_turn"]:
        cells = []
        for label in ("affinity", "none"):
            row = setups[label]["by_turn"][turn]
            cells += [f"{row['cached_tokens_p50']:.0f} / {row['input_tokens_p50']:.0f}",
                      f"{row['ttft_s_p50'] * 1000:.0f}"]
        table.add_row(str(turn), *cells)
    return table


@app.command("flood")
def flood(
    rounds: int = typer.Option(3, min=1, help="Rounds of: the victim alone, then under each flood (tier x rate)."),
    streams: int = typer.Option(120, min=1, help="The victim's streams per phase."),
    concurrency: int = typer.Option(8, min=1, help="The victim's streams at once."),
    max_tokens: int = typer.Option(32, min=2, help="Tokens per victim stream."),
    tokens_per_s: float = typer.Option(50.0, min=1, help="Tokens per second per stream (synthetic engine)."),
    connections: int = typer.Option(32, min=1, help="The attacker's keep-alive connections."),
    rate: list[float] = typer.Option([300.0], "--rate", min=0, help="Requests per second the attacker offers, all "
                                     "kinds together (0: each connection sends as soon as it is answered); repeat "
                                     "for a flood at each rate in every round."),
    tier: list[str] = typer.Option(["plus", "free"], "--tier", help="An attacking org of this tier; repeat for one of "
                                   "each (free: nearly all refused, what the refusals cost; plus: its allowance "
                                   "served too)."),
    pin: bool = typer.Option(True, help="The gateway on a core of its own, the clients on the others."),
    port_base: int = typer.Option(17900, help="First port of the bench stack's services."),
    as_json: bool = JSON,
) -> None:
    """One tenant's flood of resumes, list reads and conversation writes vs another tenant's TTFT and ITL."""
    from bench.tenant_flood import FloodShape, run

    out = _out(as_json)
    shape = FloodShape(rounds=rounds, streams=streams, concurrency=concurrency, max_tokens=max_tokens,
                       tokens_per_s=tokens_per_s, connections=connections, rates=tuple(rate), tiers=tuple(tier))
    result = asyncio.run(run(load_settings(), shape, port_base=port_base, pin=pin, say=_say(out)))
    if not as_json:
        for table in flood_tables(result):
            show(out, table)
        b = result["bound"]
        for name, check in b["by_flood"].items():
            verdict = "[green]holds[/green]" if check["holds"] else "[red]does not hold[/red]"
            moves = ", ".join(f"{m * 1000:+.0f}" for m in check["moved_by_round_s"])
            out.print(f"bound, {name}: TTFT p99 moved {check['moved_s'] * 1000:+.0f} ms (median of the rounds: "
                      f"{moves}; alone {check['alone_p99_s'] * 1000:.0f}), allowed {check['allowed_s'] * 1000:.0f} "
                      f"(the larger of {b['share']:.0%} and {b['floor_s'] * 1000:.0f} ms): {verdict}")
    _saved(out, as_json, save("tenant-flood", result))


def flood_tables(result: dict[str, Any]) -> list[Table]:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1000:.0f}"

    phases = Table(title="the victim per phase (ms); the attacker's requests/s, 429s; the gateway's CPU s")
    for column in ("round", "phase", "done", "TTFT p50/p99", "ITL p50/p99", "att. /s", "429", "gw CPU"):
        phases.add_column(column, justify="left" if column == "phase" else "right")

    def row(round_: str, name: str, v: dict[str, Any], a: dict[str, Any] | None, gateway_s: float) -> None:
        refused = "-" if a is None else str(a["reads"].get("429", 0) + a["writes"].get("429", 0))
        phases.add_row(round_, name, f"{v['completed']}/{v['streams']}",
                       f"{ms(v['ttft_s']['p50'])}/{ms(v['ttft_s']['p99'])}",
                       f"{ms(v['itl_s']['p50'])}/{ms(v['itl_s']['p99'])}", "-" if a is None else f"{a['per_s']:g}",
                       refused, f"{gateway_s:.1f}")

    for p in result["phases"]:
        row(str(p["round"] + 1), p["phase"], p["victim"], p["attacker"], p["cpu_s"]["gateway"])
    for name, pooled in result["pooled"].items():
        row("all", name, pooled, pooled.get("attacker"), pooled["cpu_s"]["gateway"])
    tables = [phases]
    for name, pooled in result["pooled"].items():
        if "attacker" not in pooled:
            continue
        kinds = Table(title=f"the attacker's answers, {name} (all rounds)")
        for column in ("request", "per s", "admitted", "429", "other"):
            kinds.add_column(column, justify="left" if column == "request" else "right")
        for kind, counted in pooled["attacker"]["by_kind"].items():
            statuses = counted["statuses"]
            admitted = sum(n for s, n in statuses.items() if s.startswith("2"))
            other = ", ".join(f"{s}: {n}" for s, n in statuses.items() if not s.startswith("2") and s != "429")
            kinds.add_row(kind, f"{counted['per_s']:g}", str(admitted), str(statuses.get("429", 0)), other or "-")
        tables.append(kinds)
    return tables
