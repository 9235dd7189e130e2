"""``kns safety eval``: precision, recall and latency of each classifier on the shipped evaluation set."""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import track
from rich.table import Table

from runtime.cli_tables import emit_json, show
from runtime.settings import load_settings
from stream_processors.safety.classifier import CLASSIFIERS, DATA, load_labelled, make_classifier

app = typer.Typer(help="The safety classifiers.", no_args_is_help=True)
console = Console()
err = Console(stderr=True)
EVAL_SET = DATA / "eval.v1.jsonl"


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
    precision = tp / (tp + len(fps)) if tp + len(fps) else 0.0
    recall = tp / (tp + len(misses)) if tp + len(misses) else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    ordered = sorted(latencies)
    return Scores(classifier.name, precision, recall, f1, fps, misses, statistics.median(ordered),
                  ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))])


@app.command("eval")
def evaluate_command(
    classifier: list[str] = typer.Option(None, "--classifier", "-c", help="Default: all of them."),
    show_errors: bool = typer.Option(False, "--errors", help="List false positives and misses."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table, for scripts (with the "
                                 "false positives and misses)."),
) -> None:
    """Score the classifiers on the evaluation set (disjoint from the exemplars they use)."""
    rows = load_labelled(EVAL_SET)
    harmful = sum(r["label"] != "benign" for r in rows)
    results = [evaluate(name, quiet=as_json) for name in (classifier or list(CLASSIFIERS))]
    if as_json:
        emit_json({"eval_set": EVAL_SET.name, "texts": len(rows), "harmful": harmful,
                   "classifiers": [asdict(s) for s in results]})
        return
    show(console, scores_table(results, f"{EVAL_SET.name}: {len(rows)} texts, {harmful} harmful"))
    if show_errors:
        for s in results:
            console.print(f"[bold]{s.classifier}[/bold] false positives: {s.false_positives}\n  misses: {s.misses}")


def scores_table(results: list[Scores], title: str) -> Table:
    table = Table(title=title)
    for column in ("classifier", "precision", "recall", "F1", "p50 ms", "p99 ms"):
        table.add_column(column, justify="right" if column != "classifier" else "left")
    for s in results:
        table.add_row(s.classifier, f"{s.precision:.3f}", f"{s.recall:.3f}", f"{s.f1:.3f}", f"{s.p50_ms:.1f}",
                      f"{s.p99_ms:.1f}")
    return table
