"""``kns chaos SCENARIO``: run bounded fault scenarios against a stack of their own and print what they did."""

from __future__ import annotations

import asyncio

import typer
from rich.console import Console
from rich.table import Table as RichTable

from bench.chaos.audit import Table
from bench.chaos.run import LoadShape, run_scenario
from bench.chaos.scenarios import SCENARIOS
from bench.common import save, stop_cleanly_on_sigterm
from runtime.settings import load_settings

console = Console()


def chaos(
    scenario: str = typer.Argument(..., help=f"one of: {', '.join(SCENARIOS)}, or all"),
    requests: int = typer.Option(32, min=1, help="Streams to send."),
    concurrency: int = typer.Option(8, min=1, help="Streams in flight at once."),
    max_tokens: int = typer.Option(60, min=1, help="Tokens per stream (ignore_eos)."),
    engine: str = typer.Option("synthetic", help="synthetic (checked token by token) or vllm."),
    temperature: float = typer.Option(0.0, help="Sampling temperature of the load."),
    seed: int | None = typer.Option(None, help="A seed for every request (temperature > 0)."),
    mixed: bool = typer.Option(False, help="Every other stream greedy (temperature 0, no seed)."),
    port_base: int = typer.Option(17500, help="First port of the chaos stack's services."),
) -> None:
    """Break the platform on purpose, under load, and count what was lost, duplicated or billed wrongly."""
    names = list(SCENARIOS) if scenario == "all" else [scenario]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        raise typer.BadParameter(f"unknown scenario {unknown[0]!r}; one of: {', '.join(SCENARIOS)}, all")
    if engine not in ("synthetic", "vllm"):
        raise typer.BadParameter("--engine must be synthetic or vllm")
    stop_cleanly_on_sigterm()
    settings = load_settings()
    shape = LoadShape(requests, concurrency, max_tokens, temperature, seed, mixed)
    tables = []
    for name in names:
        console.rule(f"[bold]{name}[/bold]: {SCENARIOS[name].summary}")
        table, streams, context = asyncio.run(run_scenario(
            settings, SCENARIOS[name], shape, engine=engine, port_base=port_base,
            say=lambda m: console.print(f"[dim]•[/dim] {m}")))
        path = save(f"chaos-{name}", {**context, "table": table.as_json(),
                                      "streams": [s.as_json() for s in streams]})
        console.print(f"[green]saved[/green] {path}")
        tables.append(table)
    console.print(render(tables))
    raise typer.Exit(0 if all(t.goals_met for t in tables) else 1)


def render(tables: list[Table]) -> RichTable:
    """Metrics down, scenarios across: fits a terminal with several scenarios."""
    out = RichTable(title="kns chaos")
    out.add_column("")
    for t in tables:
        out.add_column(t.scenario, justify="right")

    def recover(t: Table) -> str:
        r = t.recover_s
        return "-" if r.get("p50") is None else f"{r['p50']:.1f} / {r['p99']:.1f} s ({t.affected_streams})"

    def resumed(t: Table) -> str:
        r = t.resume_gap_s
        gap = "" if r.get("p50") is None else f", gap {r['p50']:.2f} / {r['p99']:.2f} s"
        return f"{t.resumed_streams}{gap}"

    rows = {
        "sent": lambda t: str(t.sent),
        "completed": lambda t: str(t.completed),
        "failed, by reason": lambda t: ", ".join(f"{n} {r}" for r, n in sorted(t.failed.items())) or "0",
        "tokens duplicated": lambda t: str(t.tokens_duplicated),
        "tokens lost": lambda t: str(t.tokens_lost),
        "spliced streams": lambda t: str(t.spliced_streams),
        "tokens generated twice": lambda t: str(t.tokens_generated_twice),
        "requests taken over": lambda t: str(t.taken_over),
        "recovery p50 / p99 (streams)": recover,
        "streams resumed elsewhere (gap p50 / p99)": resumed,
        "ledger minus replay": lambda t: str(t.ledger_minus_replay),
        "billed for nobody": lambda t: str(t.billed_for_nobody),
        "spend minus ledger (USD)": lambda t: t.spend_minus_ledger_usd + (" (wiped)" if t.spend_wiped else ""),
        "tokens received, not billed": lambda t: str(t.billed_short),
        "turns misrecorded (of checked)": lambda t: f"{t.turns_misrecorded} ({t.turns_checked})"
        if t.turns_checked else "-",
        "goals": lambda t: "[green]met[/green]" if t.goals_met else "[red]NOT MET[/red]",
    }
    for label, cell in rows.items():
        out.add_row(label, *(cell(t) for t in tables))
    return out
