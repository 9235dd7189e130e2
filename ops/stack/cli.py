"""``kns stack``: up, down, status, logs."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import typer
from rich.console import Console
from rich.table import Table

from ops.stack.manager import ServiceStatus, StackManager
from ops.stack.process import tail
from ops.stack.services import StackError
from runtime.cli_tables import emit_json, show
from runtime.settings import load_settings

app = typer.Typer(help="The local stack: Kafka, Cassandra, Redis, the inference worker and the gateway.",
                  no_args_is_help=True)
console = Console()
err = Console(stderr=True)


def _manager() -> StackManager:
    return StackManager(load_settings(), report=lambda msg: console.print(f"[dim]•[/dim] {msg}"))


def _fail(exc: StackError) -> typer.Exit:
    err.print(f"[bold red]error:[/bold red] {exc}")
    return typer.Exit(code=1)


@app.command()
def up(
    infra_only: bool = typer.Option(False, "--infra-only", help="Only Kafka, Cassandra and Redis."),
) -> None:
    """Install what is missing, start every service, wait until each is healthy."""
    manager = _manager()
    started = time.monotonic()
    try:
        result = asyncio.run(manager.up(app=not infra_only))
    except StackError as exc:
        raise _fail(exc) from exc
    if result.topics_created:
        console.print(f"[dim]•[/dim] created {len(result.topics_created)} topics")
    if result.dev_key_new:
        console.print(
            f"\n[bold]Dev API key[/bold] (shown once; also in {manager.stack.dev_key_file}, mode 0600):\n"
            f"  {result.dev_key}\n"
            f"An admin key for the admin API (/v1/admin/...) is in {manager.stack.dev_admin_key_file}.\n"
        )
    console.print(
        f"[green]stack up[/green] in {time.monotonic() - started:.1f} s — started: "
        f"{', '.join(result.started) or 'nothing'}; already running: {', '.join(result.already_running) or 'nothing'}"
    )


@app.command()
def down(
    wipe: bool = typer.Option(False, "--wipe", help="Also delete all data, logs and the dev key."),
    service: list[str] = typer.Option(None, "--service", "-s", help="Stop only these services."),
) -> None:
    """Stop the services this stack started (and nothing else). Data is kept unless --wipe."""
    stopped = _manager().down(wipe=wipe, only=service or None)
    console.print(f"[green]stopped[/green]: {', '.join(stopped) or 'nothing was running'}")


def _human(size: int) -> str:
    value = float(size)
    for unit in ("B", "KB", "MB", "GB"):
        if value < 1024 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GB"


@app.command()
def status(as_json: bool = typer.Option(False, "--json", help="The services as JSON, for scripts.")) -> None:
    """A table of the services: pid, ports, health, data size."""
    rows = asyncio.run(_manager().status())
    if as_json:
        emit_json([{"service": r.name, "pid": r.pid, "ports": r.ports, "healthy": r.healthy,
                    "data_bytes": r.data_bytes, "endpoint": r.details} for r in rows])
        return
    show(console, status_table(rows))


def status_table(rows: list[ServiceStatus]) -> Table:
    table = Table(title="kns local stack")
    table.add_column("service")
    table.add_column("health", overflow="fold")
    table.add_column("data")
    for column in ("ports", "endpoint"):
        table.add_column(column, overflow="fold")
    for row in rows:
        if row.healthy:
            health = f"[green]healthy[/green], pid {row.pid}"
        else:
            health = f"[red]unhealthy[/red], pid {row.pid}" if row.pid else "[dim]stopped[/dim]"
        table.add_row(row.name, health, _human(row.data_bytes), ", ".join(map(str, row.ports)), row.details)
    return table


@app.command()
def logs(
    service: str = typer.Argument(..., help="kafka, cassandra, redis, worker or gateway"),
    lines: int = typer.Option(40, "--lines", "-n"),
    follow: bool = typer.Option(False, "--follow", "-f"),
) -> None:
    """Show (or follow) a service's log file."""
    try:
        svc = _manager().service(service)
    except StackError as exc:
        raise _fail(exc) from exc
    if follow:
        subprocess.run(["tail", "-n", str(lines), "-F", str(svc.log_file)], check=False)
    else:
        sys.stdout.write(tail(svc.log_file, lines))
