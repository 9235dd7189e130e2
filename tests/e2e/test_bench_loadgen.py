"""The load generator against the real gateway: measures a good run, reports errors by status, never crashes."""

from __future__ import annotations

import pytest

from bench.loadgen import Target, plan, run_load
from bench.workload import Shape
from tests.conftest import Caller
from tests.e2e.conftest import MODEL

pytestmark = pytest.mark.e2e


async def test_a_run_measures_every_request(base_url: str, caller: Caller) -> None:
    run = plan(Target(base_url, MODEL, caller.secret), Shape("fixed", 4, 16, 6), concurrency=2)
    await run_load(run)
    s = run.summary()
    assert s["completed"] == 4 and s["errors"] == {}
    assert s["output_tokens"] == 24  # ignore_eos: exactly max_tokens each
    assert 0 < s["ttft_s"]["p50"] <= s["e2e_s"]["p50"] and s["itl_s"]["p50"] > 0
    assert s["output_tokens_per_s"] > 0


async def test_errors_are_reported_by_status_code(base_url: str) -> None:
    run = plan(Target(base_url, MODEL, "sk-kns-wrong"), Shape("fixed", 3, 8, 4), concurrency=3)
    await run_load(run)
    assert run.summary()["errors"] == {"401": 3}
    assert "invalid_api_key" in (run.results[0].error or "")


async def test_an_unreachable_server_is_a_connection_error() -> None:
    run = plan(Target("http://127.0.0.1:9/v1", MODEL), Shape("fixed", 2, 8, 4), concurrency=1)
    await run_load(run)
    assert run.summary()["errors"] == {"connection": 2}
