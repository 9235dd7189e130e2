"""Analysts: the usage topic exported to Parquet and CSV, readable with DuckDB."""

from __future__ import annotations

import asyncio
import csv
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path

import duckdb
import openai
import pytest

from runtime.settings import Settings
from schemas.events import UsageEvent
from schemas.topics import TOPICS
from tests.e2e.conftest import MODEL, QUESTION, kns, records_of
from tests.helpers import wait_for

pytestmark = pytest.mark.e2e


async def test_export_matches_the_usage_topic(client: openai.OpenAI, stack: Settings, service_env: dict[str, str],
                                              tmp_path: Path) -> None:
    answer = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=3)
    start, end = datetime.now(UTC) - timedelta(hours=2), datetime.now(UTC) + timedelta(seconds=1)

    async def committed_with_this_answer() -> list[UsageEvent]:
        # The reply does not wait for the worker's transaction: its usage event may not be readable committed yet.
        usage = await records_of(stack, TOPICS.usage, UsageEvent, lambda u: start <= u.requested_at < end)
        return usage if any(u.request_id == answer.id for u in usage) else []

    committed = await wait_for(committed_with_this_answer, timeout_s=30)
    assert committed, f"the usage of {answer.id} was never committed"
    window = ["--start", start.isoformat(), "--end", end.isoformat()]
    for fmt in ("parquet", "csv"):
        out = tmp_path / f"usage.{fmt}"
        result = await asyncio.to_thread(kns, service_env, "billing", "export", "-f", fmt, "-o", str(out), *window)
        assert result.returncode == 0, result.stderr
    # The topic is the session's: an earlier test's usage may commit while the export runs. The export holds what
    # was committed before it ran, and nothing the topic does not hold after it.
    after = await records_of(stack, TOPICS.usage, UsageEvent, lambda u: start <= u.requested_at < end)
    exported = Counter(r for (r,) in duckdb.sql(f"select request_id from '{tmp_path / 'usage.parquet'}'").fetchall())
    before_ids, after_ids = Counter(u.request_id for u in committed), Counter(u.request_id for u in after)
    assert before_ids <= exported <= after_ids, (before_ids - exported, exported - after_ids)
    assert exported[answer.id] == 1
    ((completion,),) = duckdb.sql(
        f"select completion_tokens from '{tmp_path / 'usage.parquet'}' where request_id = '{answer.id}'").fetchall()
    assert completion == answer.usage.completion_tokens  # type: ignore[union-attr]
    with (tmp_path / "usage.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert before_ids <= Counter(row["request_id"] for row in rows) <= after_ids  # written by a second run
    assert {"request_id", "org_id", "key_id", "completion_tokens", "requested_at", "billed"} <= set(rows[0])
