"""Test helpers: our services as real subprocesses, readers of what they wrote to Kafka, token events for a relay."""

from __future__ import annotations

import asyncio
import functools
import os
import selectors
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import ParamSpec, TypeVar

import httpx
from aiokafka import TopicPartition
from aiokafka.admin import NewTopic

from producers.relay.collector import Delta, StreamCollector
from runtime.kafka_clients import all_partitions, make_admin, make_consumer, read_to_end
from runtime.settings import REPO_ROOT, KafkaSettings
from schemas.codec import EventCodec
from schemas.events import Event, TokenEvent, TokenUsage

T = TypeVar("T")
P = ParamSpec("P")

# One folder per test session port base: two sessions on one machine keep their own logs.
LOG_DIR = REPO_ROOT / ".local" / "test-logs" / os.environ.get("KNS_TEST_PORT_BASE", "18000")


@dataclass
class ServiceProcess:
    """``python -m ops.cli <command>`` with its own environment, log file and health URL."""

    name: str
    command: str
    env: dict[str, str]
    health_url: str
    args: list[str] = field(default_factory=list)
    log_path: Path = field(init=False)
    proc: subprocess.Popen[bytes] | None = None

    def __post_init__(self) -> None:
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        self.log_path = LOG_DIR / f"{self.name}.log"
        self.log_path.unlink(missing_ok=True)  # this session's log only; restarts append to it

    def start(self) -> None:
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ops.cli", self.command, *self.args], cwd=REPO_ROOT, env=self.env,
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(self.health_url, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not healthy after {timeout_s} s:\n{self.tail()}")

    def children(self) -> list[int]:
        assert self.proc is not None
        path = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        return [int(pid) for pid in path.read_text().split()] if path.exists() else []

    def kill(self) -> None:
        """SIGKILL the whole process group: no clean-up, no commit, as a crash."""
        assert self.proc is not None
        os.killpg(self.proc.pid, 9)
        self.proc.wait(10)

    def stop(self, timeout_s: float = 30) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        os.killpg(self.proc.pid, 15)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
            return self.proc.wait(10)

    def tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")


Row = tuple[TopicPartition, int, Event, list[tuple[str, bytes]]]


@asynccontextmanager
async def scratch_topics(kafka: KafkaSettings, *topics: NewTopic) -> AsyncIterator[None]:
    """Topics of a test's own on the real broker, deleted afterwards (also when the test fails)."""
    admin = make_admin(kafka)
    await admin.start()
    try:
        await admin.create_topics(list(topics))
        try:
            yield
        finally:
            await admin.delete_topics([t.name for t in topics])
    finally:
        await admin.close()


async def read_topic(kafka: KafkaSettings, topic: str, codec: EventCodec[Event], *,
                     isolation: str = "read_committed") -> list[Row]:
    """Everything currently in a topic (up to its end offsets), decoded."""
    return await read_to_end(kafka, topic, codec, isolation=isolation)  # type: ignore[arg-type]


async def end_offsets(kafka: KafkaSettings, topic: str) -> dict[int, int]:
    consumer = make_consumer(kafka, role="test-offsets")
    await consumer.start()
    try:
        partitions = await all_partitions(consumer, topic)
        ends = await consumer.end_offsets(partitions)
        return {tp.partition: off for tp, off in ends.items()}
    finally:
        await consumer.stop()


async def group_past_every_record(kafka: KafkaSettings, group: str, topic: str, codec: EventCodec[Event]) -> bool:
    """Whether a consumer group has committed, on every partition of ``topic``, past the last record it holds now
    (read_committed: a transaction's commit marker takes an offset of its own, so the end offset is no measure)."""
    rows = await read_topic(kafka, topic, codec)
    last: dict[TopicPartition, int] = {}
    for tp, offset, _event, _headers in rows:
        last[tp] = max(last.get(tp, -1), offset)
    admin = make_admin(kafka)
    await admin.start()
    try:
        committed = await admin.list_consumer_group_offsets(group)
    finally:
        await admin.close()
    return all(tp in committed and committed[tp].offset > offset for tp, offset in last.items())


def group_by_request(events: list[Event]) -> dict[str, list[Event]]:
    grouped: dict[str, list[Event]] = defaultdict(list)
    for event in events:
        grouped[event.request_id].append(event)  # type: ignore[attr-defined]
    return grouped


async def wait_for(predicate, timeout_s: float = 20.0, interval_s: float = 0.1, *,
                   what: str | None = None):
    """Poll an (async or sync) predicate until it returns something truthy; the last value otherwise, or, when
    ``what`` says what was awaited, an AssertionError naming it (a deadline that fails loudly)."""
    deadline = time.monotonic() + timeout_s
    value = None
    while time.monotonic() < deadline:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        await asyncio.sleep(interval_s)
    if what is not None:
        raise AssertionError(f"{what}: not within {timeout_s} s (last: {value!r})")
    return value


def wait_until(predicate: Callable[[], object], what: str, timeout_s: float = 20.0, interval_s: float = 0.02
               ) -> None:
    """``wait_for`` for synchronous tests (child processes, files): poll until truthy, or fail naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        time.sleep(interval_s)


class _JumpingSelector(selectors.DefaultSelector):
    """Polls without blocking; when nothing is ready and the loop would sleep until its next timer, moves the
    loop's virtual clock to that timer instead."""

    loop: VirtualTimeLoop

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = super().select(0)
        if ready or timeout == 0:
            return ready
        if timeout is None:  # no timer at all: only another thread could wake the loop
            ready = super().select(_IDLE_REAL_S)
            if not ready:
                raise RuntimeError(f"every task waits and no timer is set: deadlocked for {_IDLE_REAL_S} s")
            return ready
        self.loop.virtual_now += timeout
        return []


_IDLE_REAL_S = 10.0


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop on a virtual clock that jumps to the next timer whenever every task is waiting.

    ``asyncio.sleep``, ``wait_for`` timeouts and ``loop.time()`` run on it: a backoff of seconds takes no wall
    time, and timers fire in the order of their deadlines however loaded the machine is. Code that reads
    ``time.monotonic()`` itself needs the loop's ``time`` passed in as its clock."""

    def __init__(self) -> None:
        selector = _JumpingSelector()
        super().__init__(selector)
        selector.loop = self
        self.virtual_now = 0.0

    def time(self) -> float:
        return self.virtual_now


def in_virtual_time(test: Callable[P, Awaitable[None]]) -> Callable[P, None]:
    """A test coroutine run to its end on its own ``VirtualTimeLoop`` (a synchronous test for pytest; its
    fixtures are passed through). Objects built outside the test belong to another loop: build them inside."""
    @functools.wraps(test)
    def run(*args: P.args, **kwargs: P.kwargs) -> None:
        run_in_virtual_time(lambda: test(*args, **kwargs))

    return run


def run_in_virtual_time(scenario: Callable[[], Awaitable[T]]) -> T:
    """Run ``scenario()`` to its end on a fresh ``VirtualTimeLoop`` (a synchronous test's whole body); the tasks
    it leaves behind are cancelled before the loop closes."""
    loop = VirtualTimeLoop()
    try:
        return loop.run_until_complete(scenario())
    finally:
        leftovers = asyncio.all_tasks(loop)
        for task in leftovers:
            task.cancel()
        if leftovers:
            loop.run_until_complete(asyncio.gather(*leftovers, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


def token_event(request_id: str, seq: int, text: str | None = None, final: bool = False) -> TokenEvent:
    """One token event of attempt 1 (token id = seq; text ``<seq>`` unless given); ``final`` ends the stream."""
    return TokenEvent(request_id=request_id, attempt=1, seq=seq, token_offset=seq, token_ids=[seq],
                      text=f"<{seq}>" if text is None else text, finish_reason="stop" if final else None,
                      usage=TokenUsage(prompt_tokens=1, completion_tokens=seq + 1) if final else None,
                      worker_id="test", emitted_at_us=time.time_ns() // 1000)


async def drain_stream(collector: StreamCollector, timeout_s: float = 10) -> tuple[str, Delta]:
    """A relay collector's deltas to its end: (the text, the last delta)."""
    parts = []
    while True:
        delta = await asyncio.wait_for(collector.get(), timeout_s)
        parts.append(delta.text)
        if delta.finished:
            return "".join(parts), delta
