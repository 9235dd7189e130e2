"""``kns bench kafka-hop``'s reader process: never left running, whichever way the benchmark leaves it.

The child is replaced by small programs (``bench.kafka_hop.child_command``) that behave as a reader might: slow to
get ready, saying something else, never ready. Each writes its pid to a file, so the test can see it gone.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from aiokafka.errors import KafkaConnectionError

from bench import kafka_hop
from runtime.reaper import is_alive, read_proc
from runtime.settings import KafkaSettings

REPO = Path(__file__).resolve().parents[2]


def _program(tmp_path: Path, body: str) -> list[str]:
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(f"""
        import os, sys, time
        from pathlib import Path
        Path({str(tmp_path / "pid")!r}).write_text(str(os.getpid()))
    """) + textwrap.dedent(body))
    return [sys.executable, str(script)]


def _gone(tmp_path: Path, within_s: float = 2.0) -> bool:
    """The child has finished (a zombie nobody reaped yet counts: it runs no more; a recycled pid is another)."""
    proc = read_proc(int((tmp_path / "pid").read_text()))
    deadline = time.monotonic() + within_s
    while proc is not None and is_alive(proc):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


async def _wait_for_pid(tmp_path: Path) -> None:
    for _ in range(500):
        if (tmp_path / "pid").exists() and (tmp_path / "pid").read_text():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the child did not start")


def test_cancelled_while_the_reader_starts_kills_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    command = _program(tmp_path, 'time.sleep(2); print("ready", flush=True); time.sleep(60)')
    monkeypatch.setattr(kafka_hop, "child_command", lambda *_: command)

    async def main() -> None:
        starting = asyncio.create_task(kafka_hop._reader_process(KafkaSettings(), "t", 10))
        await _wait_for_pid(tmp_path)
        starting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await starting

    asyncio.run(main())
    assert _gone(tmp_path)


def test_a_reader_that_says_something_else_fails_at_once_and_is_killed(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    command = _program(tmp_path, 'print("hello", flush=True); time.sleep(1); print("ready", flush=True); '
                                 'time.sleep(60)')
    monkeypatch.setattr(kafka_hop, "child_command", lambda *_: command)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="did not get ready"):
        asyncio.run(kafka_hop._reader_process(KafkaSettings(), "t", 10))
    assert time.monotonic() - started < 10
    assert _gone(tmp_path)


def test_a_reader_never_ready_times_out_and_is_killed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    command = _program(tmp_path, "time.sleep(60)")
    monkeypatch.setattr(kafka_hop, "child_command", lambda *_: command)
    monkeypatch.setattr(kafka_hop, "READY_TIMEOUT_S", 3.0)  # long enough for the child to start on a loaded box
    with pytest.raises(TimeoutError):
        asyncio.run(kafka_hop._reader_process(KafkaSettings(), "t", 10))
    assert _gone(tmp_path)


class _Producer:
    """The benchmark's producer, failing its first send or taking every record."""

    def __init__(self, fail: bool) -> None:
        self.fail = fail
        self.stopped = False

    async def start(self) -> None:
        pass

    async def send_and_wait(self, *_: object, **__: object) -> None:
        if self.fail:
            raise KafkaConnectionError("broker away")

    async def stop(self) -> None:
        self.stopped = True


def test_a_producer_that_fails_stops_the_reader(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    command = _program(tmp_path, 'print("ready", flush=True); time.sleep(60)')
    monkeypatch.setattr(kafka_hop, "child_command", lambda *_: command)
    producer = _Producer(fail=True)
    monkeypatch.setattr(kafka_hop, "make_producer", lambda *_, **__: producer)
    with pytest.raises(KafkaConnectionError):
        asyncio.run(kafka_hop._one_setting(KafkaSettings(), "t", 100, 10, 0.0, own_process=True))
    assert _gone(tmp_path)
    assert producer.stopped


def test_a_reader_that_never_answers_times_out_and_is_killed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    command = _program(tmp_path, 'print("ready", flush=True); time.sleep(60)')
    monkeypatch.setattr(kafka_hop, "child_command", lambda *_: command)
    monkeypatch.setattr(kafka_hop, "make_producer", lambda *_, **__: _Producer(fail=False))
    monkeypatch.setattr(kafka_hop, "ANSWER_TIMEOUT_S", 0.5)
    with pytest.raises(TimeoutError):
        asyncio.run(kafka_hop._one_setting(KafkaSettings(), "t", 100, 10, 0.0, own_process=True))
    assert _gone(tmp_path)


def test_a_reader_that_answers_is_measured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    answer = '{"hops": [0.001, 0.002, 0.003], "cpu_s": 0.05, "wall_s": 0.5}'
    command = _program(tmp_path, f'print("ready", flush=True); time.sleep(0.2); print({answer!r}, flush=True)')
    monkeypatch.setattr(kafka_hop, "child_command", lambda *_: command)
    monkeypatch.setattr(kafka_hop, "make_producer", lambda *_, **__: _Producer(fail=False))
    result = asyncio.run(kafka_hop._one_setting(KafkaSettings(), "t", 100, 3, 0.0, own_process=True))
    assert result["consumer"] == "own process"
    assert result["records"] == 3
    assert result["hop_s"]["p50"] == pytest.approx(0.002)
    assert result["client_cpu_share_of_one_core"] >= 0.1  # the reader's tenth of a core at least
    assert _gone(tmp_path)


def test_a_long_answer_is_read_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--records 7000``: the reader's answer is one line of about 80 kB, past asyncio's 64 KiB line limit."""
    answer = '{"hops": [' + ", ".join(["0.0011623"] * 7000) + '], "cpu_s": 0.01, "wall_s": 1.0}'
    command = _program(tmp_path, f'print("ready", flush=True); print({answer!r}, flush=True)')
    monkeypatch.setattr(kafka_hop, "child_command", lambda *_: command)
    monkeypatch.setattr(kafka_hop, "make_producer", lambda *_, **__: _Producer(fail=False))
    result = asyncio.run(kafka_hop._one_setting(KafkaSettings(), "t", 100, 1, 0.0, own_process=True))
    assert result["records"] == 7000


def test_a_reader_that_dies_after_ready_fails_the_setting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    command = _program(tmp_path, 'print("ready", flush=True); sys.exit(3)')
    monkeypatch.setattr(kafka_hop, "child_command", lambda *_: command)
    monkeypatch.setattr(kafka_hop, "make_producer", lambda *_, **__: _Producer(fail=False))
    with pytest.raises(RuntimeError, match="exit 3"):
        asyncio.run(kafka_hop._one_setting(KafkaSettings(), "t", 100, 3, 0.0, own_process=True))


def test_the_reader_dies_with_the_benchmark(tmp_path: Path) -> None:
    """A benchmark killed with SIGKILL runs no ``finally``: its reader process goes with it all the same."""
    child = _program(tmp_path, 'print("ready", flush=True); time.sleep(60)')
    benchmark = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import asyncio, time
        from bench import kafka_hop
        from runtime.settings import KafkaSettings
        kafka_hop.child_command = lambda *_: {child!r}
        async def main():
            await kafka_hop._reader_process(KafkaSettings(), "t", 10)
            print("positioned", flush=True)
            await asyncio.sleep(60)
        asyncio.run(main())
    """)], cwd=REPO, stdout=subprocess.PIPE)
    try:
        assert benchmark.stdout is not None
        assert benchmark.stdout.readline().strip() == b"positioned"
        assert not _gone(tmp_path, within_s=0.3)  # alive while the benchmark is
        benchmark.kill()
        benchmark.wait(timeout=10)
    finally:
        benchmark.kill()
    assert _gone(tmp_path)
