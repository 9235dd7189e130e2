"""Every table the CLI prints stays whole at 80 columns (a narrow terminal, or a pipe, where Rich assumes 80): no
cell cut to an ellipsis, every value on the page. The benchmarks' tables are fed their newest result files from
bench/results; the chaos summary is drawn from the audit's own ``Table``; ``--json`` prints what parses."""

from __future__ import annotations

import dataclasses
import glob
import io
import json
import re
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console, RenderableType
from rich.table import Table
from rich.text import Text
from typer.testing import CliRunner

from bench import cli as bench_cli
from bench.chaos.audit import Table as ChaosTable
from bench.chaos.cli import HEADLINE, LABELS, _detail, details, headline
from billing.cli import prices_table, reconcile_table, spend_table
from billing.ledger import Totals
from billing.prices import Price
from billing.reconcile import Report
from ops.keys_cli import _key_table, _org_table, suspended_table
from ops.stack.cli import status_table
from ops.stack.manager import ServiceStatus
from ops.topics_cli import tokens_table, topics_table
from runtime.cli_tables import show
from runtime.settings import KafkaSettings
from runtime.spend import Spend
from schemas.events import KeyRecord, LimitOverrides, OrgRecord
from schemas.topics import TOPICS
from stream_processors.safety.evaluate import Scores, scores_table

RESULTS = Path(bench_cli.__file__).parent / "results"
WIDTH = 80
NOW = datetime(2026, 11, 27, 0, 41, 20, tzinfo=UTC)
#: what separates two cells on a line: a column rule, or the two spaces (at least) every layout leaves
CELL_GAP = re.compile(r"[│┃]| {2,}")


def _plain(cell: RenderableType) -> str:
    return Text.from_markup(cell).plain if isinstance(cell, str) else str(getattr(cell, "plain", cell))


def render(renderable: RenderableType, width: int = WIDTH) -> str:
    console = Console(width=width, record=True, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


def shown_whole(table: Table, width: int = WIDTH) -> str:
    """Print ``table`` as the CLI does and check it: nothing past the width, no ellipsis, each cell's text a cell of
    the page (a prose column's, which may wrap between words: each of its words)."""
    cells = [(_plain(cell), column.overflow == "fold") for column in table.columns for cell in column.cells]
    console = Console(width=width, record=True, file=io.StringIO())
    show(console, table)
    text = console.export_text()
    assert "…" not in text, text
    assert max(map(len, text.splitlines()), default=0) <= width, text
    fragments = {part.strip() for line in text.splitlines() for part in CELL_GAP.split(line)}
    words = set(text.split())
    for value, prose in cells:
        if not value.strip():
            continue
        if prose:
            missing = [w for w in value.split() if w not in words]
            assert not missing, f"{value!r}: {missing} not on the page\n{text}"
        else:
            assert value.strip() in fragments, f"{value!r} is not a whole cell on the page\n{text}"
    return text


def newest(kind: str, having: str | None = None) -> dict[str, Any]:
    for path in sorted(glob.glob(str(RESULTS / f"{kind}-2*.json")), reverse=True):
        data = json.loads(Path(path).read_text())
        if having is None or data.get(having):
            return data  # type: ignore[no-any-return]
    raise AssertionError(f"no {kind} result in {RESULTS}")


# --- the layouts --------------------------------------------------------------------------------------------------


def _wide(rows: int) -> Table:
    table = Table(title="wide")
    for n in range(12):
        table.add_column(f"figure number {n}", justify="right")
    for r in range(rows):
        table.add_row(*(f"{r}-{n * 1000 + 123}" for n in range(12)))
    return table


def test_a_table_that_fits_is_printed_as_it_is() -> None:
    table = Table(title="narrow")
    table.add_column("a")
    table.add_row("1")
    assert "┏" in shown_whole(table)


def test_a_wide_table_of_few_rows_is_turned_a_line_per_column() -> None:
    text = shown_whole(_wide(2))
    assert re.search(r"figure number 11 +│ +0-11123 │ +1-11123 │", text), text


def test_a_wide_table_of_many_rows_is_printed_a_block_per_row() -> None:
    text = shown_whole(_wide(9))
    assert re.search(r"figure number 11 +8-11123", text), text


def test_without_fit_rich_cuts_the_cells_of_a_wide_table() -> None:
    """The control: what the layouts are for."""
    assert "…" in render(_wide(9))


# --- ops, billing, safety ------------------------------------------------------------------------------------------


def test_the_stack_status_is_whole_at_80_columns() -> None:
    rows = [ServiceStatus("kafka", 3234, [19092, 19093], True, 794_624, "bootstrap 127.0.0.1:19092, metrics :19404"),
            ServiceStatus("processor-billing", None, [8202], False, 0, "metrics http://127.0.0.1:8202/metrics"),
            ServiceStatus("gateway", 4194304, [8000], False, 0, "http://127.0.0.1:8000/v1")]
    text = shown_whole(status_table(rows))
    assert "unhealthy" in text and "stopped" in text


def test_the_tenancy_tables_are_whole_at_80_columns() -> None:
    orgs = [OrgRecord(org_id="acme-research-eu", name="Acme Research Europe", tier="enterprise",
                      limits=LimitOverrides(requests_per_minute=12_000, max_concurrent=2_000),
                      monthly_budget_micros=25_000_000_000, created_at=NOW, updated_at=NOW),
            OrgRecord(org_id="free-trial-7", name="", tier="free", created_at=NOW, updated_at=NOW)]
    shown_whole(_org_table(orgs))
    keys = [KeyRecord(key_hash="h", key_id="key_0123456789abcdef", org_id="acme-research-eu", name="batch jobs",
                      models=["SmolLM2-135M-Instruct", "SmolLM2-360M-Instruct"], expires_at=NOW,
                      revoked_at=NOW, created_at=NOW),
            KeyRecord(key_hash="h", key_id="key_fedcba9876543210", org_id="free-trial-7", name="", created_at=NOW)]
    shown_whole(_key_table(keys))
    shown_whole(suspended_table([{"key_id": "key_0123456789abcdef", "org_id": "acme-research-eu",
                                  "reason": "request_burst: 30 in 10 s (limit 30)",
                                  "alert_id": "9f2c4e1a7b3d5c6e8f01", "suspended_at": NOW}]))


def test_the_topic_map_and_token_events_are_whole_at_80_columns() -> None:
    kafka = KafkaSettings()
    rows = [{"topic": kafka.topic(spec.name), "event": spec.event.__name__ if spec.event else "raw", "key": spec.key,
             "partitions": spec.partitions, "retention_ms": spec.retention_ms, "offsets": 123_456,
             "producers": list(spec.producers), "consumers": list(spec.consumers)} for spec in TOPICS.all()]
    shown_whole(topics_table(rows))
    events = [{"partition": 11, "offset": 1_234_567, "time": "2026-11-27T00:41:20.123+00:00",
               "request_id": "chatcmpl-9f2c4e1a7b3d5c6e8f0123456789abcd", "attempt": 2, "seq": 17,
               "token_ids": [1030, 260, 4718], "text": " Paris is [the] capital", "finish_reason": None},
              {"partition": 11, "offset": 1_234_568, "time": "2026-11-27T00:41:20.175+00:00",
               "request_id": "chatcmpl-9f2c4e1a7b3d5c6e8f0123456789abcd", "attempt": 2, "seq": 18, "token_ids": [],
               "text": "", "finish_reason": "length"}]
    text = shown_whole(tokens_table(events, "llm.tokens.emitted.v1 · chatcmpl-9f2c4e1a7b3d5c6e8f0123456789abcd"))
    assert "[the]" in text  # token text is text, not markup


def test_the_billing_tables_are_whole_at_80_columns() -> None:
    report = Report(expected={("acme-research-eu", "SmolLM2-135M-Instruct"): Totals(1200, 1_500_000, 640_000, 0,
                                                                                  Decimal("1.23456789"))},
                    actual={("acme-research-eu", "SmolLM2-135M-Instruct"): Totals(1199, 1_499_000, 639_000, 0,
                                                                                Decimal("1.23356789")),
                            ("free-trial-7", "SmolLM2-135M-Instruct"): Totals(3, 30, 12, 0, Decimal("0.00000123"))})
    text = shown_whole(reconcile_table(report))
    assert "DIFF" in text
    shown_whole(prices_table([Price("SmolLM2-135M-Instruct", NOW, "2026-11-launch", Decimal("0.05"),
                                    Decimal("0.025"), Decimal("0.2"))]))
    shown_whole(spend_table("acme-research-eu", "2026-11", Spend(1_234_567_890, 98_765_432, 17), 1_234_567_890,
                            Spend(1_234_567_890, 0, 0)))


def test_the_safety_scores_are_whole_at_80_columns() -> None:
    scores = [Scores("combined/rules.v1+minilm-nn.v3", 0.971, 0.943, 0.957, [], [], 4.2, 11.9)]
    shown_whole(scores_table(scores, "eval.v1.jsonl: 82 texts, 35 harmful"))


# --- the benchmarks, from their newest results ----------------------------------------------------------------------


def test_the_benchmark_tables_are_whole_at_80_columns() -> None:
    compare = newest("compare", having="referee")
    relay = newest("relay", having="stream_runs")
    tables = [
        bench_cli.billing_table(newest("billing-replay")),
        bench_cli._summary_table("load", [newest("load")["summary"]]),
        bench_cli.comparison_table(compare), *bench_cli.cpu_tables(compare), bench_cli.referee_table(compare),
        bench_cli.kafka_hop_table(newest("kafka-hop")["results"], "Kafka hop, 500 records, one every 20 ms"),
        bench_cli.relay_table(relay["stream_runs"], 1),
        bench_cli.relay_table(newest("relay", having="held")["stream_runs"], 1),
        *bench_cli.limiter_tables(newest("limiter")),
        bench_cli.priority_table(newest("priority")),
        bench_cli.failover_table(newest("failover")),
        bench_cli.transport_table(newest("transport")),
        bench_cli.capacity_table(newest("capacity")),
        bench_cli.scale_table(newest("scale")),
        bench_cli.affinity_table(newest("affinity")),
    ]
    for table in tables:
        shown_whole(table)


def test_the_comparison_prints_whole_at_80_columns() -> None:
    console = Console(width=WIDTH, record=True, file=io.StringIO())
    bench_cli.show_comparison(newest("compare", having="referee"), console)
    assert "…" not in console.export_text()


def test_bench_json_prints_the_saved_result(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import bench.common
    from ops.cli import app

    monkeypatch.setattr(bench.common, "RESULTS", tmp_path)
    result = CliRunner().invoke(app, ["bench", "capacity", "--json"])
    assert result.exit_code == 0, result.output
    printed = json.loads(result.stdout)
    (saved,) = tmp_path.glob("capacity-*.json")
    assert printed == json.loads(saved.read_text()) and printed["plans"]


def test_safety_eval_json_parses() -> None:
    from ops.cli import app

    result = CliRunner().invoke(app, ["safety", "eval", "-c", "rules", "--json"])
    assert result.exit_code == 0, result.output
    scores = json.loads(result.stdout)
    assert scores["texts"] == 82 and scores["classifiers"][0]["classifier"].startswith("rules")


# --- kns chaos -------------------------------------------------------------------------------------------------------


def _every_field_set() -> dict[str, Any]:
    """A chaos table with every field of the audit's ``Table`` set to something worth showing, whatever its fields
    are now: a field added to the audit must show without a change to the CLI."""
    table = ChaosTable("commit-timeout")
    for f in dataclasses.fields(ChaosTable):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if f.name == "scenario":
            continue
        if isinstance(default, bool):
            value: Any = True
        elif isinstance(default, int):
            value = 7
        elif isinstance(default, str):
            value = "0.000042"
        elif isinstance(default, dict):
            value = {"stream timeout": 2, "p99": 1.25}
        elif isinstance(default, list):
            value = [f"{f.name} missed: 3 streams of 32, against 0 promised"]
        else:
            continue
        setattr(table, f.name, value)
    return table.as_json()


def test_the_chaos_summary_of_every_scenario_is_whole_at_80_columns() -> None:
    tables = sorted({json.loads(Path(p).read_text())["table"]["scenario"]: json.loads(Path(p).read_text())["table"]
                     for p in sorted(glob.glob(str(RESULTS / "chaos-*.json")))}.values(), key=lambda t: t["scenario"])
    assert len(tables) >= 14
    text = shown_whole(headline(tables))
    assert all(t["scenario"] in text for t in tables)
    assert "…" not in render(details(tables))


def test_the_chaos_details_show_every_field_of_the_audit() -> None:
    table = _every_field_set()
    head = shown_whole(headline([table]))
    text = render(details([table]))
    assert "…" not in text and max(map(len, text.splitlines())) <= WIDTH
    flat = " ".join(text.split())
    for key, value in table.items():
        if key in HEADLINE and not isinstance(value, dict):
            assert HEADLINE[key] in head
            continue
        assert LABELS.get(key, key.replace("_", " ")) in text, f"{key} is not in the details\n{text}"
        for line in _detail(value).splitlines():
            assert " ".join(line.split()) in flat, f"{key}: {line!r} is not in the details\n{text}"


def test_a_missed_goal_reads_not_met() -> None:
    table = ChaosTable("kill-worker", sent=32, completed=31, failed={"stream timeout": 1}).as_json()
    table["missed"] = ["every stream completes: 31 of 32"]
    table["goals_met"] = False
    assert "NOT MET" in render(headline([table])) and "every stream completes: 31 of 32" in render(details([table]))
