"""The benchmark harness's pure parts: workloads, validation, aggregation."""

from __future__ import annotations

import asyncio

import pytest

from bench.compare import aggregate, ratios, referee_aggregate, referee_ratios, round_shape, schedule
from bench.loadgen import RequestResult, Target, plan
from bench.workload import Shape, WorkloadError, items


def test_workloads_are_seeded_and_identical_for_both_sides() -> None:
    a, b = items(Shape("sharegpt", 50, seed=3)), items(Shape("sharegpt", 50, seed=3))
    assert a == b and items(Shape("sharegpt", 50, seed=4)) != a
    lengths = {i.max_tokens for i in a}
    assert len(lengths) > 10  # a mix, not one length
    fixed = items(Shape("fixed", 5, input_words=20, output_tokens=7))
    assert {i.max_tokens for i in fixed} == {7} and len({len(i.prompt.split()) for i in fixed}) == 1


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"concurrency": None, "rate": None}, "exactly one of"),
    ({"concurrency": 2, "rate": 1.0}, "exactly one of"),
    ({"concurrency": 0}, "--concurrency"),
    ({"rate": -1.0}, "--rate"),
])
def test_bad_load_arguments_are_explained(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(WorkloadError, match=message):
        plan(Target("http://127.0.0.1:1/v1", "m"), Shape(), **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(("shape", "message"), [
    (Shape(requests=0), "--requests"),
    (Shape(input_words=1500, output_tokens=100), "does not fit"),
    (Shape(output_tokens=0), "--output-len"),
])
def test_bad_shapes_are_explained(shape: Shape, message: str) -> None:
    with pytest.raises(WorkloadError, match=message):
        shape.validate()


@pytest.mark.parametrize("url", ["localhost:8000", "ftp://x/v1", "http://"])
def test_bad_urls_are_explained(url: str) -> None:
    with pytest.raises(WorkloadError, match="--base-url"):
        plan(Target(url, "m"), Shape(), concurrency=1)


def test_tpot_excludes_the_first_token() -> None:
    assert RequestResult(0, True, ttft=0.5, e2e=1.5, output_tokens=11).tpot == pytest.approx(0.1)
    assert RequestResult(0, True, ttft=0.5, e2e=0.5, output_tokens=1).tpot is None


def _summary(tput: float, ttft: float, itl: float) -> dict[str, object]:
    pct = lambda v: {"p50": v, "p90": v, "p99": v * 2, "mean": v}  # noqa: E731
    return {"output_tokens_per_s": tput, "output_tokens": 100, "request_throughput": 1.0, "errors": {},
            "cpu_s": {"engine": tput / 100}, "ttft_s": pct(ttft),
            "itl_s": pct(itl), "tpot_s": pct(itl), "e2e_s": pct(1.0)}


def test_medians_over_rounds_and_ratios() -> None:
    ours = aggregate([_summary(t, 0.2, 0.05) for t in (10, 30, 20)])
    vllm = aggregate([_summary(t, 0.1, 0.04) for t in (20, 20, 40)])
    assert ours["output_tokens_per_s"] == 20 and vllm["output_tokens_per_s"] == 20
    r = ratios(ours, vllm)
    assert r["output_tokens_per_s_ratio"] == 1.0
    assert r["ttft_p50_diff_ms"] == pytest.approx(100.0) and r["itl_p99_diff_ms"] == pytest.approx(20.0)
    assert ours["cpu_s_per_1k_output_tokens"] == {"engine": 2.0}  # median of 1, 3, 2 seconds per 1000 tokens


def test_every_round_and_client_sends_prompts_no_other_sent() -> None:
    """With prefix caching on, a prompt sent again skips its prefill: rounds that repeated the first round's prompts
    measured a cached TTFT (175 ms against 545 ms in compare-20261126T034444.json), so the medians were not over
    like rounds. Both sides of a round still get the very same prompts, in turns that alternate."""
    slots = list(schedule(["ours", "vllm"], [1, 8], 4, Shape("fixed", 16, 128, 64)))
    assert [(s.concurrency, s.round_no) for s in slots] == [(c, r) for c in (1, 8) for r in range(4)]
    assert [s.order[0] for s in slots] == ["ours", "vllm"] * 4 and all(len(s.order) == 2 for s in slots)
    shapes = [shape for s in slots for shape in (s.workload, s.referee_workload)]
    prompts = [frozenset(i.prompt for i in items(shape)) for shape in shapes]
    assert all(not (a & b) for n, a in enumerate(prompts) for b in prompts[n + 1:])
    # ... and part at their first words, right after the chat template's system prompt: "Request 3." first shared
    # a second 16-token block between rounds (measured with the model's tokenizer: 32 tokens in common, now 28)
    heads = [{i.prompt.split(",")[0] for i in items(shape)} for shape in shapes]
    assert all(len(h) == 1 for h in heads) and len(set().union(*heads)) == len(shapes)
    # vLLM's client seeds NumPy with it: a seed over 32 bits failed every referee run
    assert all(0 <= shape.seed < 2**32 for shape in shapes)
    assert [s.workload.requests for s in slots] == [16] * 4 + [32] * 4  # four requests per stream at least
    assert items(round_shape(Shape("fixed", 16, 128, 64), 8, 2, "kns")) == items(slots[6].workload)


def _referee_run(tput: float, ttft_ms: float, itl_ms: float) -> dict[str, object]:
    return {"completed": 16, "failed": 0, "total_input_tokens": 2600, "total_output_tokens": 1024,
            "request_throughput": tput / 64, "output_throughput": tput, "median_ttft_ms": ttft_ms,
            "p99_ttft_ms": ttft_ms * 2, "median_itl_ms": itl_ms, "p99_itl_ms": itl_ms * 2,
            "median_tpot_ms": itl_ms, "median_e2el_ms": 3000.0}


#: what vLLM's client reports when every request failed: it exits 0, with latencies of 0
_ALL_FAILED = {**_referee_run(0, 0, 0), "completed": 0, "failed": 16}


def test_the_referees_medians_are_over_the_rounds_both_sides_measured() -> None:
    agg = referee_aggregate({
        "ours": [_referee_run(18, 180, 52), _referee_run(19, 181, 52), _referee_run(17, 182, 53),
                 {"error": "connection refused"}, _referee_run(30, 10, 10)],
        "vllm": [_referee_run(19, 170, 50), _referee_run(20, 171, 50), _referee_run(18, 172, 51),
                 _referee_run(40, 5, 5), _ALL_FAILED],
    })
    ours, vllm = agg["ours"], agg["vllm"]
    assert ours["output_throughput"] == 18 and vllm["output_throughput"] == 19  # rounds 4 and 5 are unpaired
    assert ours["rounds"] == vllm["rounds"] == 3 and ours["failed_rounds"] == vllm["failed_rounds"] == 1
    assert ours["completed"] == 48 and ours["total_output_tokens"] == 3072  # counts add up; figures are medians
    r = referee_ratios(ours, vllm)
    assert r["output_tokens_per_s_ratio"] == 0.947
    assert r["median_ttft_ms_diff_ms"] == 10 and r["median_itl_ms_diff_ms"] == 2 and r["p99_itl_ms_diff_ms"] == 4
    lost = referee_aggregate({"ours": [_ALL_FAILED], "vllm": [_referee_run(19, 170, 50)]})
    assert lost["ours"]["median_ttft_ms"] is None and referee_ratios(lost["ours"], lost["vllm"]) == {
        "output_tokens_per_s_ratio": None, "median_ttft_ms_diff_ms": None, "p99_ttft_ms_diff_ms": None,
        "median_itl_ms_diff_ms": None, "p99_itl_ms_diff_ms": None}


def test_a_concurrency_given_twice_runs_once() -> None:
    """Its prompts would be the same again, answered from the prefix cache, and mixed into the same medians."""
    slots = list(schedule(["ours", "vllm"], [1, 8, 1], 2, Shape("fixed", 16, 128, 64)))
    assert [(s.concurrency, s.round_no) for s in slots] == [(1, 0), (1, 1), (8, 0), (8, 1)]


def test_requests_the_referee_saw_fail_count_even_in_a_round_the_other_side_lost() -> None:
    ok = _referee_run(18, 180, 52)
    agg = referee_aggregate({"ours": [ok, {**ok, "completed": 10, "failed": 6}], "vllm": [ok, {"error": "x"}]})
    assert agg["ours"]["failed"] == 6 and agg["ours"]["rounds"] == 1 and agg["ours"]["of_rounds"] == 2


@pytest.mark.parametrize("outcome", ["timeout", "no result file", "not an object", "killed"])
def test_a_referee_run_that_goes_wrong_loses_its_round_not_the_comparison(
        outcome: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import subprocess
    from pathlib import Path
    from types import SimpleNamespace

    from bench import compare as compare_module

    def run(cmd: list[str], **_: object) -> subprocess.CompletedProcess[str]:
        if outcome == "timeout":
            raise subprocess.TimeoutExpired(cmd, 1800, output=b"still waiting")
        if outcome == "not an object":
            out = Path(cmd[cmd.index("--result-dir") + 1]) / cmd[cmd.index("--result-filename") + 1]
            out.write_text("[1, 2]")
        return subprocess.CompletedProcess(cmd, -9 if outcome == "killed" else 0, "", "")

    monkeypatch.setattr(compare_module.subprocess, "run", run)
    side = SimpleNamespace(base_url="http://127.0.0.1:1/v1", api_key="k", label="ours")
    settings = SimpleNamespace(model=SimpleNamespace(served_name="m", path="/nowhere"))
    result = compare_module.referee(side, settings, 1, Shape("fixed", 4, 16, 8))  # type: ignore[arg-type]
    assert set(result) == {"error"} and result["error"], result
    assert {"timeout": "timed out after 1800 s: still waiting", "killed": "exit -9"}.get(
        outcome, "") in result["error"]


async def test_compare_sends_each_client_its_own_prompts_the_same_to_both_sides(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """compare() itself, its services faked: which prompts each client sent to which side, in which order."""
    from types import SimpleNamespace

    from bench import compare as compare_module
    from bench.loadgen import Run

    sent: list[tuple[str, str, int, int]] = []

    class Proc:
        pid, name = None, "p"

        def start(self) -> None: ...
        def stop(self) -> None: ...
        async def wait(self) -> None: ...

    def side(label: str) -> SimpleNamespace:
        return SimpleNamespace(label=label, base_url=f"http://{label}:1/v1", api_key="k", procs=[Proc()],
                               description=label, metrics_urls=[])

    async def our_side(*_: object, **__: object) -> SimpleNamespace:
        return side("ours")

    async def run_load(run: Run) -> Run:
        sent.append(("kns", run.target.label, run.concurrency or 0, run.shape.seed))
        run.results = [RequestResult(i.index, True, ttft=0.1, e2e=1.0, output_tokens=8, itl=[0.1])
                       for i in items(run.shape)]
        run.wall_s = 1.0
        return run

    def referee(side: SimpleNamespace, _settings: object, c: int, shape: Shape) -> dict[str, object]:
        sent.append(("referee", side.label, c, shape.seed))
        return _referee_run(18, 180, 52)

    class Stack:
        def __init__(self, _settings: object) -> None: ...
        async def up(self, **_: object) -> None: ...

    async def nothing(*_: object, **__: object) -> None: ...

    for name, fake in {"StackManager": Stack, "our_side": our_side, "vllm_side": lambda *_: side("vllm"),
                       "infra_pids": lambda _: {}, "nice_levels": lambda _: {}, "_warm": nothing,
                       "run_load": run_load, "referee": referee,
                       "CpuMeter": lambda _: SimpleNamespace(since=lambda: {})}.items():
        monkeypatch.setattr(compare_module, name, fake)
    settings = SimpleNamespace(model=SimpleNamespace(served_name="m"))
    shape = Shape("fixed", 16, 128, 64)
    results, _ = await compare_module.compare(settings, concurrencies=[1, 8], rounds=2, shape=shape,  # type: ignore[arg-type]
                                              with_referee=True, report=lambda _: None)
    expected = []
    for slot in schedule(["ours", "vllm"], [1, 8], 2, shape):
        expected += [("kns", label, slot.concurrency, slot.workload.seed) for label in slot.order]
        expected += [("referee", label, slot.concurrency, slot.referee_workload.seed) for label in slot.order]
    assert sent == expected
    assert results["referee"]["8"]["ours_vs_vllm"]["output_tokens_per_s_ratio"] == 1.0
    assert len(results["concurrency"]["1"]["rounds"]["vllm"]) == 2


def test_the_comparison_table_shows_the_referees_medians_and_failures(capsys: pytest.CaptureFixture[str]) -> None:
    from bench.cli import show_comparison

    client = {"ours": aggregate([_summary(20, 0.2, 0.2)]), "vllm": aggregate([_summary(21, 0.2, 0.2)])}
    refereed = {"ours": [_referee_run(18, 180, 52), {"error": "Traceback: the server went away"}, _ALL_FAILED],
                "vllm": [_referee_run(19, 170, 50), _referee_run(19, 170, 50), _referee_run(19, 170, 50)]}
    agg = referee_aggregate(refereed)
    show_comparison({"sides": {"ours": "us", "vllm": "them"},
                     "concurrency": {"1": {**client, "ours_vs_vllm": ratios(client["ours"], client["vllm"])}},
                     "referee": {"1": {**agg, "ours_vs_vllm": referee_ratios(agg["ours"], agg["vllm"]),
                                       "rounds": refereed}}})
    out = capsys.readouterr().out
    assert "0.947x" in out and "+10.0" in out and "+4.0" in out  # only the referee's row differs from 0
    assert "rounds lost: 2" in out and "the server went away" in out and "no request completed (16 failed)" in out
    show_comparison({"sides": {}, "concurrency": {}, "referee": {"1": {
        **(lost := referee_aggregate({"ours": [_ALL_FAILED], "vllm": [_ALL_FAILED]})),
        "ours_vs_vllm": referee_ratios(lost["ours"], lost["vllm"]), "rounds": {"ours": [_ALL_FAILED]}}}})
    assert "rounds lost: 1" in capsys.readouterr().out


def test_cpu_meter_attributes_a_childs_work_to_its_tree() -> None:
    import os
    import signal
    import subprocess
    import sys
    import time

    from bench.cpu import CpuMeter

    # The parent prints its child's pid once the child runs, then only sleeps: what its tree uses from then on is
    # the child's.
    child = "x = 0\\nwhile True: x += 1"
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                               f"c = subprocess.Popen([sys.executable, '-c', '{child}']); print(c.pid, flush=True); "
                               "time.sleep(600)"], stdout=subprocess.PIPE, text=True)
    child_pid = 0
    try:
        assert parent.stdout is not None
        child_pid = int(parent.stdout.readline())
        meter = CpuMeter({"svc": parent.pid})
        # However busy the machine, the child gets a CPU second eventually: wait for that, not for a time.
        deadline = time.monotonic() + 60
        used = meter.since()
        while sum(v for k, v in used.items() if k.startswith("svc:")) <= 1.0 and time.monotonic() < deadline:
            time.sleep(0.1)
            used = meter.since()
        assert sum(v for k, v in used.items() if k.startswith("svc:")) > 1.0, f"the child is not counted: {used}"
        assert used["svc"] < 0.2, used  # ... while the parent, which only sleeps, used next to nothing
    finally:
        if child_pid:
            os.kill(child_pid, signal.SIGKILL)
        parent.kill()
        parent.wait()


async def test_the_capacity_clients_sse_reader_times_content_chunks_that_carry_event_ids() -> None:
    """bench/sse_client.py: every event but [DONE] starts with its ``id:`` line (resumable streams); a reader
    that expected ``data:`` first saw no content at all and reported no TTFT (the relay bench did, unnoticed)."""
    import asyncio

    from bench.sse_client import stream

    events = [b'id: r:0\ndata: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n',
              b'id: r:1\ndata: {"choices":[{"delta":{"content":" a"}}]}\n\n',
              b'id: r:2\ndata: {"choices":[{"delta":{"content":" b"}}]}\n\n',
              b'id: r:4\ndata: {"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":2}}\n\n',
              b"data: [DONE]\n\n"]

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await reader.read(100)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for event in events:
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        result = await stream(f"http://127.0.0.1:{port}/v1", "k", {"model": "m"}, 0, 0.0)
    finally:
        server.close()
    assert result.ok and result.ttft is not None and len(result.itl) == 1 and result.output_tokens == 2


async def _serve_once(response: bytes, piece: int) -> tuple[asyncio.Server, int]:
    """A server that answers one request with ``response``, written ``piece`` bytes at a time."""
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        for i in range(0, len(response), piece):
            writer.write(response[i:i + piece])
            await writer.drain()
            await asyncio.sleep(0)
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_the_capacity_clients_reader_finds_events_split_anywhere_between_reads(loop: str) -> None:
    """The client splits events on raw bytes (no chunked decoding): a read may end anywhere, in the headers, a
    chunk's size line or an event. The relay bench runs it under uvloop, whose transports are other classes."""
    import uvloop

    (uvloop.run if loop == "uvloop" else asyncio.run)(_split_reads())


async def _split_reads() -> None:
    from bench.sse_client import stream

    events = [b'id: r:0\ndata: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n',
              *(b'id: r:%d\ndata: {"choices":[{"delta":{"content":" t%d"}}]}\n\n' % (i, i) for i in range(1, 6)),
              b'id: r:7\ndata: {"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":5}}\n\n',
              b"data: [DONE]\n\n"]
    response = (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
                + b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n")
    for piece in (3, 7, 50):
        server, port = await _serve_once(response, piece)
        try:
            result = await asyncio.wait_for(stream(f"http://127.0.0.1:{port}/v1", "k", {"model": "m"}, 0, 0.0), 10)
        finally:
            server.close()
        assert result.ok and result.error is None, (piece, result)
        assert result.ttft is not None and len(result.itl) == 4 and result.output_tokens == 5, (piece, result)


async def test_the_capacity_clients_reader_reports_a_refusal_with_its_body() -> None:
    from bench.sse_client import stream

    body = b'{"error":{"message":"Rate limit reached","type":"rate_limit_error"}}'
    server, port = await _serve_once(b"HTTP/1.1 429 Too Many Requests\r\ncontent-length: %d\r\n\r\n%s"
                                     % (len(body), body), 10)
    try:
        result = await stream(f"http://127.0.0.1:{port}/v1", "k", {"model": "m"}, 0, 0.0)
    finally:
        server.close()
    assert not result.ok and result.status == 429 and "Rate limit reached" in (result.error or "")
