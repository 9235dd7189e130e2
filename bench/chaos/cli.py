"""``kns chaos SCENARIO``: run bounded fault scenarios against a stack of their own and print what they did.

The summary is drawn from ``Table.as_json()`` alone, so a field the audit gains shows without a change here: one
scenario per row with the columns that decide a run, then each scenario's details (every other field that is not
zero or empty, and each goal missed). ``--json`` prints every field of every table.
"""

from __future__ import annotations

import asyncio
from typing import Any

import typer
from rich.console import Console, Group, RenderableType
from rich.markup import escape
from rich.table import Table as RichTable
from rich.text import Text

from bench.chaos.run import LoadShape, run_scenario
from bench.chaos.scenarios import SCENARIOS
from bench.common import save, stop_cleanly_on_sigterm
from runtime.cli_tables import emit_json, show
from runtime.settings import load_settings

console = Console()
err = Console(stderr=True)
#: the summary's columns: a field of ``Table.as_json()`` and its short name (a dict field shows its total)
HEADLINE = {"scenario": "scenario", "sent": "sent", "completed": "done", "failed": "failed",
            "tokens_lost": "lost", "tokens_duplicated": "dup", "spliced_streams": "spliced", "goals_met": "goals"}
#: names for the details where the field's own reads badly; any other field shows under its own name
LABELS = {"failed": "failed, by outcome", "recover_s": "recovery of affected streams (s)",
          "resume_gap_s": "resume gap (s)", "spend_minus_ledger_usd": "spend minus ledger (USD)",
          "billed_short": "tokens received, not billed", "taken_over": "requests taken over",
          "expected": "expected", "missed": "goals missed"}


def chaos(
    scenario: str = typer.Argument(..., help=f"one of: {', '.join(SCENARIOS)}, or all"),
    requests: int = typer.Option(32, min=1, help="Streams to send."),
    concurrency: int = typer.Option(8, min=1, help="Streams in flight at once."),
    max_tokens: int = typer.Option(60, min=1, help="Tokens per stream (ignore_eos)."),
    engine: str = typer.Option("synthetic", help="synthetic (checked token by token) or vllm."),
    temperature: float = typer.Option(0.0, help="Sampling temperature of the load."),
    seed: int | None = typer.Option(None, help="A seed for every request (temperature > 0)."),
    mixed: bool = typer.Option(False, help="Every other stream greedy (temperature 0, no seed); every third a "
                                            "structured output (a JSON schema)."),
    port_base: int = typer.Option(17500, help="First port of the chaos stack's services."),
    as_json: bool = typer.Option(False, "--json", help="Print every table as JSON (with the file each was saved "
                                 "to) instead of the summary; progress goes to stderr."),
) -> None:
    """Break the platform on purpose, under load, and count what was lost, duplicated or billed wrongly."""
    names = list(SCENARIOS) if scenario == "all" else [scenario]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        raise typer.BadParameter(f"unknown scenario {unknown[0]!r}; one of: {', '.join(SCENARIOS)}, all")
    if engine not in ("synthetic", "vllm"):
        raise typer.BadParameter("--engine must be synthetic or vllm")
    stop_cleanly_on_sigterm()
    out = err if as_json else console
    settings = load_settings()
    shape = LoadShape(requests, concurrency, max_tokens, temperature, seed, mixed)
    tables, saved = [], []
    for name in names:
        out.rule(f"[bold]{name}[/bold]: {SCENARIOS[name].summary}")
        table, streams, context = asyncio.run(run_scenario(
            settings, SCENARIOS[name], shape, engine=engine, port_base=port_base,
            say=lambda m: out.print(f"[dim]•[/dim] {m}")))
        path = save(f"chaos-{name}", {**context, "table": table.as_json(),
                                      "streams": [s.as_json() for s in streams]})
        out.print(f"[green]saved[/green] {path}")
        tables.append(table)
        saved.append(str(path))
    met = all(t.goals_met for t in tables)
    if as_json:
        emit_json({"goals_met": met, "scenarios": [{"table": t.as_json(), "saved": path}
                                                    for t, path in zip(tables, saved, strict=True)]})
    else:
        show(console, headline([t.as_json() for t in tables]))
        console.print(details([t.as_json() for t in tables]))
    raise typer.Exit(0 if met else 1)


def headline(tables: list[dict[str, Any]]) -> RichTable:
    """One scenario per row, the columns that decide a run."""
    out = RichTable(title="kns chaos")
    fields = [f for f in HEADLINE if any(f in t for t in tables)]
    for f in fields:
        out.add_column(HEADLINE[f], justify="left" if f == "scenario" else "right")
    for t in tables:
        out.add_row(*(_headline_cell(f, t.get(f)) for f in fields))
    return out


def details(tables: list[dict[str, Any]]) -> Group:
    """Per scenario, every field the summary leaves out (a dict in the summary: its parts too) that is not zero or
    empty, one a line. A field that is not listed was zero or empty."""
    parts: list[RenderableType] = []
    for t in tables:
        grid = RichTable.grid(padding=(0, 2))
        grid.add_column(no_wrap=True)
        grid.add_column(overflow="fold")
        for key, value in t.items():
            if (key in HEADLINE and not isinstance(value, dict)) or _empty(value):
                continue
            grid.add_row(LABELS.get(key, key.replace("_", " ")), escape(_detail(value)))
        verdict = "[green]goals met[/green]" if t.get("goals_met") else "[red]goals NOT MET[/red]"
        parts += [Text(""), Text.from_markup(f"[bold]{escape(str(t.get('scenario', '?')))}[/bold]: {verdict}")]
        if grid.row_count:
            parts.append(grid)
    return Group(*parts)


def _headline_cell(field: str, value: Any) -> str:
    if field == "goals_met":
        return "[green]met[/green]" if value else "[red]NOT MET[/red]"
    if isinstance(value, dict):
        return str(sum(v for v in value.values() if isinstance(v, int | float)))
    return "-" if value is None else escape(str(value))


def _empty(value: Any) -> bool:
    if isinstance(value, dict):
        return all(_empty(v) for v in value.values())
    if isinstance(value, list | tuple | set):
        return not value
    return value is None or value is False or value == 0 or value in ("", "0")


def _detail(value: Any, *, nested: bool = False) -> str:
    """A field as text: a dict as ``name: value; ...``; a list of sentences one a line, other lists on one."""
    if isinstance(value, dict):
        return "; ".join(f"{str(k).replace('_', ' ')}: {_detail(v, nested=True)}" for k, v in value.items()
                         if v is not None)
    if isinstance(value, list | tuple | set):
        items = [_detail(v, nested=True) for v in value]
        sentences = not nested and any(" " in item for item in items)
        return ("\n" if sentences else ", ").join(items)
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)
