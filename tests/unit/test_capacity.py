"""The capacity model's arithmetic (``bench/capacity.py``), on result files written here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import capacity
from bench.capacity import MODELS, Assumptions, Load, gpus, plan


def relay_level(requests: int, events: int, cpu_s: float, wall_s: float = 10.0) -> dict[str, object]:
    return {"streams": requests, "completed": requests, "wall_s": wall_s, "relayed_events_per_s": events / wall_s,
            "cpu_cores": {"relay-gateway": cpu_s / wall_s, "clients": 0.5}}


@pytest.fixture
def results(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(capacity, "RESULTS", tmp_path)
    # gateway CPU = 2 ms per request + 50 µs per event, at levels with different tokens per request
    levels = [relay_level(r, e, r * 2e-3 + e * 50e-6) for r, e in ((200, 4000), (400, 32000), (2000, 60000))]
    runs = [{"record_version": 3, "gateway_processes": 1, "levels": levels[:2], "max_streams_within_limits": 400},
            {"record_version": 2, "gateway_processes": 1, "levels": [relay_level(100, 100, 99.0)]}]
    held = {"record_version": 3, "gateway_processes": 2, "levels": levels[2:], "max_streams_within_limits": 3000}
    (tmp_path / "relay-20261124T000000.json").write_text(json.dumps({"stream_runs": [*runs, held], "held": held}))
    (tmp_path / "transport-20261124T000000.json").write_text(json.dumps({"rows": [
        {"version": 3, "concurrency": 64, "records_per_token": 0.02, "bytes_per_token": 30.0},
        {"version": 3, "concurrency": 256, "records_per_token": 0.005, "bytes_per_token": 25.0},
        {"version": 2, "concurrency": 256, "records_per_token": 1.0, "bytes_per_token": 200.0}]}))
    return tmp_path


def test_the_fit_separates_request_and_event_costs_and_skips_v2(results: Path) -> None:
    m = capacity.measured()
    assert m.gateway_s_per_request == pytest.approx(2e-3)
    assert m.gateway_s_per_event == pytest.approx(50e-6)
    assert m.streams_per_gateway == 1500  # the held run's streams over its two processes
    assert (m.records_per_token, m.bytes_per_token) == (0.005, 25.0)  # the highest concurrency


def test_batch_one_decode_bound_is_bandwidth_over_weights() -> None:
    llama8b = MODELS[0]
    assert gpus(llama8b, Load("x", 1, 1), Assumptions())["batch1_tok_s_bound"] == pytest.approx(209.4, abs=0.1)


def test_a_ten_times_smaller_load_needs_about_ten_times_fewer_gpus_and_gateways(results: Path) -> None:
    m, a = capacity.measured(), Assumptions()
    big = plan(Load("big", 50_000, 50_000_000), m, a, MODELS[0])
    small = plan(Load("small", 5_000, 5_000_000), m, a, MODELS[0])
    assert 9 <= big["gpu"]["gpus"] / small["gpu"]["gpus"] <= 11
    assert 9 <= big["gateway"]["processes"] / small["gateway"]["processes"] <= 11
    assert small["kafka"]["brokers"] >= a.replication and small["cassandra_nodes"] >= a.replication


def test_the_report_is_written_between_the_markers_only(results: Path, tmp_path: Path) -> None:
    doc = tmp_path / "CAPACITY.md"
    doc.write_text(f"# prose\n{capacity.BEGIN}\nSTALE SECTION\n{capacity.END}\nmore prose\n")
    capacity.write_into(doc, capacity.markdown(capacity.report()))
    text = doc.read_text()
    assert text.startswith("# prose\n") and text.endswith("more prose\n") and "STALE SECTION" not in text
    assert "| seeds' peak" in text and text.count(capacity.BEGIN) == 1


def test_a_newer_run_of_busy_streams_does_not_hide_the_idle_heavy_streams_held(results: Path) -> None:
    """A later ``kns bench relay`` of a few hundred busy streams (part B only) says nothing of how many idle
    streams a process holds: the newest ``--held`` result still sets it (it read 250 instead of 10,000)."""
    busy = {"record_version": 3, "gateway_processes": 1, "levels": [relay_level(250, 500_000, 9.0)],
            "max_streams_within_limits": 250}
    (results / "relay-20261125T000000.json").write_text(json.dumps({"stream_runs": [busy]}))
    assert capacity.measured().streams_per_gateway == 1500
