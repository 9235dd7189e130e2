"""``kns safety eval``: precision, recall and latency of each classifier on the shipped evaluation set, and of the
pre-filter's whole-prompt screening with each text placed where a request can hide it (``SHAPES``)."""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import track
from rich.table import Table

from runtime.cli_tables import emit_json, show
from runtime.settings import load_settings
from schemas.events import ChatMessage, ChatRequest, ReplyTo, SamplingSpec
from stream_processors.safety.classifier import CLASSIFIERS, DATA, SafetyClassifier, load_labelled, make_classifier
from stream_processors.safety.screening import PromptScreen

app = typer.Typer(help="The safety classifiers.", no_args_is_help=True)
console = Console()
err = Console(stderr=True)
EVAL_SET = DATA / "eval.v1.jsonl"
#: benign prose (about 2,500 characters, 20 sentences): the long part of a long prompt
PADDING = (DATA / "padding.v1.txt").read_text().strip()


def _user(text: str) -> ChatMessage:
    return ChatMessage(role="user", content=text)


#: where a text of the evaluation set sits in a request: what the pre-filter must screen wherever it is
SHAPES: dict[str, Callable[[str], list[ChatMessage]]] = {
    "user turn": lambda text: [_user(text)],
    "system message": lambda text: [ChatMessage(role="system", content=text), _user("Follow the instructions.")],
    "earlier turn": lambda text: [_user(text), ChatMessage(role="assistant", content="Sure, here it is."),
                                  _user("Go on, in more detail please.")],
    "before padding": lambda text: [_user(f"{text}\n\n{PADDING}")],
}


@dataclass(frozen=True)
class Scores:
    classifier: str
    precision: float
    recall: float
    f1: float
    false_positives: list[str]
    misses: list[str]
    p50_ms: float
    p99_ms: float


def evaluate(name: str, path: Path = EVAL_SET, *, quiet: bool = False) -> Scores:
    rows = load_labelled(path)
    classifier = make_classifier(load_settings().safety, name)
    latencies, tp, fps, misses = [], 0, [], []
    for row in track(rows, description=f"{name:>9}", console=err if quiet else console, transient=True):
        started = time.perf_counter()
        (verdict,) = classifier.classify([row["text"]])
        latencies.append((time.perf_counter() - started) * 1000)
        harmful = row["label"] != "benign"
        tp += verdict.blocked and harmful
        if verdict.blocked and not harmful:
            fps.append(row["text"])
        if harmful and not verdict.blocked:
            misses.append(row["text"])
    return _scores(classifier.name, tp, fps, misses, latencies)


def as_request(messages: list[ChatMessage], n: int = 0) -> ChatRequest:
    return ChatRequest(request_id=f"eval-{n}", created_at=datetime.now(UTC), org_id="eval", key_id="eval",
                       tier="free", model="m", messages=messages, prompt_token_ids=[1],
                       sampling=SamplingSpec(max_tokens=1), stream=False, reply=ReplyTo(partition=0, gateway_id="e"))


def screening(shape: str, classifier: SafetyClassifier, path: Path = EVAL_SET, *, quiet: bool = False) -> Scores:
    """The pre-filter's verdict (``screening.PromptScreen``) on each text of the set placed as ``shape`` says, one
    request at a time, nothing remembered between them."""
    rows = load_labelled(path)

    async def judge() -> list[tuple[bool, float]]:
        judged = []
        for n, row in enumerate(track(rows, description=f"{shape:>14}", console=err if quiet else console,
                                      transient=True)):
            started = time.perf_counter()
            (verdict,) = await PromptScreen(classifier).verdicts([as_request(SHAPES[shape](row["text"]), n)])
            judged.append((verdict.blocked, (time.perf_counter() - started) * 1000))
        return judged

    tp, fps, misses, latencies = 0, [], [], []
    for row, (blocked, ms) in zip(rows, asyncio.run(judge()), strict=True):
        latencies.append(ms)
        harmful = row["label"] != "benign"
        tp += blocked and harmful
        if blocked and not harmful:
            fps.append(row["text"])
        if harmful and not blocked:
            misses.append(row["text"])
    return _scores(shape, tp, fps, misses, latencies)


def _scores(name: str, tp: int, fps: list[str], misses: list[str], latencies: list[float]) -> Scores:
    precision = tp / (tp + len(fps)) if tp + len(fps) else 0.0
    recall = tp / (tp + len(misses)) if tp + len(misses) else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    ordered = sorted(latencies)
    return Scores(name, precision, recall, f1, fps, misses, statistics.median(ordered),
                  ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))])


@app.command("eval")
def evaluate_command(
    classifier: list[str] = typer.Option(None, "--classifier", "-c", help="Default: all of them."),
    show_errors: bool = typer.Option(False, "--errors", help="List false positives and misses."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table, for scripts (with the "
                                 "false positives and misses)."),
    shapes: list[str] = typer.Option(None, "--placed", "-p", help=f"Score the pre-filter with the texts placed "
                                     f"only so ({', '.join(SHAPES)}); default: each way, unless --classifier is "
                                     "given. --placed none: not at all."),
) -> None:
    """Score the classifiers on the evaluation set (disjoint from the exemplars they use)."""
    rows = load_labelled(EVAL_SET)
    harmful = sum(r["label"] != "benign" for r in rows)
    results = [evaluate(name, quiet=as_json) for name in (classifier or list(CLASSIFIERS))]
    placed = _placed(shapes, chosen=bool(classifier))
    prefilter = make_classifier(load_settings().safety) if placed else None
    screened = [screening(shape, prefilter, quiet=as_json) for shape in placed if prefilter is not None]
    if as_json:
        emit_json({"eval_set": EVAL_SET.name, "texts": len(rows), "harmful": harmful,
                   "classifiers": [asdict(s) for s in results],
                   "prefilter": {"classifier": prefilter.name if prefilter else None,
                                 "placed": [asdict(s) for s in screened]}})
        return
    show(console, scores_table(results, f"{EVAL_SET.name}: {len(rows)} texts, {harmful} harmful"))
    if prefilter is not None:
        show(console, scores_table(screened, f"the pre-filter ({prefilter.name}), each text placed as:", "placed as",
                                   "ms a request"))
    if show_errors:
        for s in [*results, *screened]:
            console.print(f"[bold]{s.classifier}[/bold] false positives: {s.false_positives}\n  misses: {s.misses}")


def _placed(asked: list[str] | None, *, chosen: bool) -> list[str]:
    """The placements to score: every one unless classifiers were chosen (the pre-filter's is the default one)."""
    if asked is None:
        return [] if chosen else list(SHAPES)
    if asked == ["none"]:
        return []
    unknown = [shape for shape in asked if shape not in SHAPES]
    if unknown:
        raise typer.BadParameter(f"unknown placement {unknown[0]!r}; one of {', '.join(SHAPES)} or none",
                                 param_hint="--placed")
    return asked


def scores_table(results: list[Scores], title: str, first: str = "classifier", per: str = "ms") -> Table:
    table = Table(title=title)
    for column in (first, "precision", "recall", "F1", f"p50 {per}", f"p99 {per}"):
        table.add_column(column, justify="right" if column != first else "left")
    for s in results:
        table.add_row(s.classifier, f"{s.precision:.3f}", f"{s.recall:.3f}", f"{s.f1:.3f}", f"{s.p50_ms:.1f}",
                      f"{s.p99_ms:.1f}")
    return table
