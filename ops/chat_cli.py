"""``kns chat``: stream an answer through the platform with the official openai SDK, token by token."""

from __future__ import annotations

import time
from pathlib import Path

import openai
import typer
from openai.types.chat import ChatCompletionMessageParam
from rich.console import Console

from runtime.settings import load_settings

console = Console()
err = Console(stderr=True)


def read_dev_key(path: Path) -> str:
    if not path.exists():
        raise typer.BadParameter(f"no API key given and {path} does not exist (run `kns stack up` first)")
    return path.read_text().strip()


def chat(
    prompt: str = typer.Argument("What is the capital of France?", help="The user message."),
    system: str | None = typer.Option(None, help="An optional system message."),
    max_tokens: int = typer.Option(128, min=1),
    temperature: float = typer.Option(0.0, min=0.0, max=2.0),
    base_url: str | None = typer.Option(None, help="Defaults to this stack's gateway."),
    api_key: str | None = typer.Option(None, envvar="OPENAI_API_KEY", help="Defaults to .local/dev-api-key."),
) -> None:
    """Ask one question and stream the answer to the terminal."""
    settings = load_settings()
    url = base_url or f"http://{settings.gateway.host}:{settings.gateway.port}/v1"
    client = openai.OpenAI(base_url=url, api_key=api_key or read_dev_key(settings.stack.dev_key_file))
    messages: list[ChatCompletionMessageParam] = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": prompt})
    console.print(f"[bold]user:[/bold] {prompt}\n[bold]assistant:[/bold] ", end="")
    started = time.perf_counter()
    first: float | None = None
    request_id = ""
    try:
        stream = client.chat.completions.create(
            model=settings.model.served_name, messages=messages, stream=True,
            max_tokens=max_tokens, temperature=temperature, stream_options={"include_usage": True},
        )
        for chunk in stream:
            request_id = chunk.id
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter()
                console.print(chunk.choices[0].delta.content, end="", markup=False, highlight=False)
            if chunk.usage is not None:
                usage = chunk.usage
                ttft = (first - started) * 1000 if first else float("nan")
                console.print(
                    f"\n\n[dim]{request_id} · {usage.prompt_tokens} prompt + {usage.completion_tokens} completion "
                    f"tokens · first token {ttft:.0f} ms · total {(time.perf_counter() - started) * 1000:.0f} ms"
                    f"\nits token events: kns tokens --request-id {request_id}[/dim]"
                )
    except openai.APIError as exc:
        err.print(f"\n[red]error:[/red] {exc}")
        raise typer.Exit(1) from exc
