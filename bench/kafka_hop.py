"""The Kafka produce → consume hop on this machine, and what the consumer's fetch wait costs in CPU.

A producer sends one small record at a time (a token event's size) to a fresh topic; a manually assigned consumer
reads it; the hop is consume time minus the timestamp the producer put in the record. Repeated for several
``fetch_max_wait_ms`` values: a long poll returns as soon as a record arrives, so a short wait buys no latency but
makes an idle consumer re-poll the broker all the time. Process CPU time (this process: both clients) is reported.

Each setting runs twice: with the consumer in this process, and in a process of its own, as the pipeline's hops
are (gateway → worker, worker → gateway): whether waking a process idle in its wait adds to the broker's round
trip. (On this box it does not: the two agree within noise, DEVELOPERS.md "Benchmarks on 2 cores".)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any, Protocol

from aiokafka import TopicPartition
from aiokafka.admin import NewTopic

from bench.common import percentiles
from runtime.kafka_clients import make_admin, make_consumer, make_producer
from runtime.settings import KafkaSettings
from runtime.supervisor import die_with_parent

PAYLOAD = b"x" * 120
#: how long a reader process may take to start and position itself
READY_TIMEOUT_S = 60.0
#: how long a reader may take, after the last record was sent, to report
ANSWER_TIMEOUT_S = 30.0


class Reader(Protocol):
    """A consumer reading the records the benchmark sends, positioned at the topic's end."""

    async def answer(self) -> tuple[list[float], float]:
        """Its hops (seconds) and the share of one core it spent outside this process while it read."""

    async def close(self) -> None:
        """Stop it, whether it answered or not."""


async def _one_setting(kafka: KafkaSettings, topic: str, fetch_wait_ms: int, records: int, gap_s: float,
                       *, own_process: bool) -> dict[str, Any]:
    settings = kafka.model_copy(update={"fetch_max_wait_ms": fetch_wait_ms})
    producer = make_producer(settings, role="bench-hop")
    await producer.start()
    reader: Reader | None = None
    try:
        reader = await (_reader_process if own_process else _reader_here)(settings, topic, records)
        cpu_start, wall_start = time.process_time(), time.perf_counter()
        for _ in range(records):
            await producer.send_and_wait(topic, time.time_ns().to_bytes(8, "big") + PAYLOAD, partition=0)
            await asyncio.sleep(gap_s)
        hops, reader_share = await asyncio.wait_for(reader.answer(), ANSWER_TIMEOUT_S)
        share = (time.process_time() - cpu_start) / (time.perf_counter() - wall_start) + reader_share
    finally:
        if reader is not None:
            await reader.close()
        await producer.stop()
    return {"fetch_max_wait_ms": fetch_wait_ms, "consumer": "own process" if own_process else "same process",
            "records": len(hops), "hop_s": percentiles(hops), "client_cpu_share_of_one_core": round(share, 3)}


async def _read(kafka: KafkaSettings, topic: str, records: int, positioned: asyncio.Future[None]) -> list[float]:
    """Read ``records`` records from the topic's end (``positioned`` is set once there); each one's hop."""
    consumer = make_consumer(kafka, role="bench-hop", isolation="read_uncommitted")
    await consumer.start()
    try:
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        await consumer.seek_to_end(tp)
        await consumer.position(tp)
        positioned.set_result(None)
        hops: list[float] = []
        while len(hops) < records:
            batch = await consumer.getmany(tp, timeout_ms=1000)
            now = time.time_ns()
            hops.extend((now - int.from_bytes(r.value[:8], "big")) / 1e9 for r in batch.get(tp, []) if r.value)
        return hops
    finally:
        await consumer.stop()


async def _positioned(kafka: KafkaSettings, topic: str, records: int) -> asyncio.Task[list[float]]:
    """A reader in this event loop, returned once it is positioned (its error, if it fails before)."""
    positioned: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    reading = asyncio.create_task(_read(kafka, topic, records, positioned))
    either: list[asyncio.Future[Any]] = [positioned, reading]
    try:
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        reading.cancel()
        raise
    if reading.done():
        reading.result()
    return reading


@dataclass
class _ReaderHere:
    reading: asyncio.Task[list[float]]

    async def answer(self) -> tuple[list[float], float]:
        return await self.reading, 0.0  # its CPU is this process's

    async def close(self) -> None:
        self.reading.cancel()
        await asyncio.gather(self.reading, return_exceptions=True)


async def _reader_here(kafka: KafkaSettings, topic: str, records: int) -> Reader:
    return _ReaderHere(await _positioned(kafka, topic, records))


def child_command(topic: str, records: int, kafka: KafkaSettings) -> list[str]:
    return [sys.executable, "-m", "bench.kafka_hop", topic, str(records), kafka.model_dump_json()]


@dataclass
class _ReaderProcess:
    child: asyncio.subprocess.Process

    async def answer(self) -> tuple[list[float], float]:
        assert self.child.stdout is not None
        out = await self.child.stdout.read()  # to its end: one line, longer than a stream reader's line limit
        if not out.strip():
            await self.child.wait()
            raise RuntimeError(f"the reader process failed (exit {self.child.returncode})")
        answer = json.loads(out)
        return answer["hops"], answer["cpu_s"] / answer["wall_s"]

    async def close(self) -> None:
        await _kill(self.child)


async def _reader_process(kafka: KafkaSettings, topic: str, records: int) -> Reader:
    """The reader in a child process (``python -m bench.kafka_hop``), returned once it is positioned. It dies with
    this process (a SIGKILL included: ``die_with_parent``), and Ctrl-C reaches only this process (the child is in a
    session of its own, stopped by ``close``)."""
    parent = os.getpid()
    child = await asyncio.create_subprocess_exec(*child_command(topic, records, kafka), stdout=asyncio.subprocess.PIPE,
                                                 start_new_session=True,
                                                 preexec_fn=lambda: die_with_parent(parent, set()))
    assert child.stdout is not None
    try:
        line = await asyncio.wait_for(child.stdout.readline(), READY_TIMEOUT_S)
        if line.strip() != b"ready":
            raise RuntimeError(f"the reader process did not get ready (it said {line[:80]!r})")
    except BaseException:
        await _kill(child)
        raise
    return _ReaderProcess(child)


async def _kill(child: asyncio.subprocess.Process) -> None:
    if child.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            child.kill()
    await asyncio.shield(child.wait())


async def _child(topic: str, records: int, kafka: KafkaSettings) -> None:
    """The reader process: ``ready`` once positioned, then one JSON line (its hops, its CPU and wall seconds)."""
    reading = await _positioned(kafka, topic, records)
    print("ready", flush=True)
    cpu_start, wall_start = time.process_time(), time.perf_counter()
    hops = await reading
    print(json.dumps({"hops": hops, "cpu_s": time.process_time() - cpu_start,
                      "wall_s": time.perf_counter() - wall_start}), flush=True)


async def run(kafka: KafkaSettings, waits: list[int], records: int, gap_s: float) -> list[dict[str, Any]]:
    topic = f"bench-hop-{uuid.uuid4().hex[:8]}"
    admin = make_admin(kafka)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, 1, 1)])
        return [await _one_setting(kafka, topic, wait, records, gap_s, own_process=own)
                for wait in waits for own in (False, True)]
    finally:
        await admin.delete_topics([topic])
        await admin.close()


if __name__ == "__main__":  # the reader of the own-process runs
    asyncio.run(_child(sys.argv[1], int(sys.argv[2]), KafkaSettings.model_validate_json(sys.argv[3])))
