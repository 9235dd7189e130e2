"""``kns bench``: the platform's benchmarks. Results go to ``bench/results/*.json``."""

from __future__ import annotations

import asyncio

import typer
from rich.console import Console
from rich.table import Table

from bench.common import save
from runtime.settings import load_settings

app = typer.Typer(help="Benchmarks (JSON results in bench/results/).", no_args_is_help=True)
console = Console()


@app.command("billing")
def billing(events: int = typer.Option(100_000, min=1000, help="Usage events to produce.")) -> None:
    """Export and reconcile on a usage topic of N events (own namespace and keyspace, removed after)."""
    from bench.billing_replay import run

    result = asyncio.run(run(load_settings(), events, lambda msg: console.print(f"[dim]•[/dim] {msg}")))
    table = Table(title=f"billing replay: {events} usage events")
    table.add_column("step")
    table.add_column("seconds", justify="right")
    for step, seconds in result["seconds"].items():
        table.add_row(step, f"{seconds:.2f}")
    console.print(table)
    console.print(f"export parquet {result['export_seconds']['parquet']:.2f} s, csv "
                  f"{result['export_seconds']['csv']:.2f} s; discrepancies {result['discrepancies']}")
    console.print(f"[green]saved[/green] {save('billing-replay', result)}")


@app.command("safety")
def safety(
    requests: int = typer.Option(200, min=1), concurrency: int = typer.Option(4, min=1),
    streams: int = typer.Option(10, min=1),
) -> None:
    """Pre-filter latency (submitted → admitted) and post-filter slip, on the running stack."""
    from bench.safety_latency import run

    settings = load_settings()
    result = asyncio.run(run(settings, requests, concurrency, streams))
    pre, post = result["prefilter"]["added_latency_s"], result["postfilter"]
    console.print(f"pre-filter added latency over {result['prefilter']['requests']} requests: "
                  f"p50 {pre['p50'] * 1000:.1f} ms, p99 {pre['p99'] * 1000:.1f} ms")
    console.print(f"post-filter: {post['halted']}/{len(post['streams'])} streams halted; decided at token "
                  f"p50 {post['decided_at_token']['p50']}, slip p50 {post['slip_tokens']['p50']} "
                  f"max {max((s['slip_tokens'] or 0) for s in post['streams'])} tokens")
    console.print(f"[green]saved[/green] {save('safety', result)}")
