"""The Kafka produce → consume hop on this machine, and what the consumer's fetch wait costs in CPU.

A producer sends one small record at a time (a token event's size) to a fresh topic; a manually assigned consumer
reads it; the hop is consume time minus the timestamp the producer put in the record. Repeated for several
``fetch_max_wait_ms`` values: a long poll returns as soon as a record arrives, so a short wait buys no latency but
makes an idle consumer re-poll the broker all the time. Process CPU time (this process: both clients) is reported.

Each setting runs twice: with the consumer in this process, and in a process of its own, as the pipeline's hops
are (gateway → worker, worker → gateway). In one process the consumer's event loop is awake anyway (it waits for
the producer's ack, which comes with the fetch's answer); across processes the consumer's process has to be woken
from its idle wait, which is what a pipeline hop pays on top of the broker.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from typing import Any

from aiokafka import TopicPartition
from aiokafka.admin import NewTopic

from bench.common import percentiles
from runtime.kafka_clients import make_admin, make_consumer, make_producer
from runtime.settings import KafkaSettings

#: a reader's hops (seconds), and the CPU seconds it spent outside this process
Reading = asyncio.Task[tuple[list[float], float]]
PAYLOAD = b"x" * 120


async def _one_setting(kafka: KafkaSettings, topic: str, fetch_wait_ms: int, records: int, gap_s: float,
                       *, own_process: bool) -> dict[str, Any]:
    settings = kafka.model_copy(update={"fetch_max_wait_ms": fetch_wait_ms})
    producer = make_producer(settings, role="bench-hop")
    await producer.start()
    reader: Reading | None = None
    try:
        reader = await (_reader_process if own_process else _reader_here)(settings, topic, records)
        cpu_start, wall_start = time.process_time(), time.perf_counter()
        for _ in range(records):
            await producer.send_and_wait(topic, time.time_ns().to_bytes(8, "big") + PAYLOAD, partition=0)
            await asyncio.sleep(gap_s)
        hops, reader_cpu = await asyncio.wait_for(reader, 30)
        wall = time.perf_counter() - wall_start
        cpu = time.process_time() - cpu_start + reader_cpu
    finally:
        if reader is not None:
            reader.cancel()
        await producer.stop()
    return {"fetch_max_wait_ms": fetch_wait_ms, "consumer": "own process" if own_process else "same process",
            "records": len(hops), "hop_s": percentiles(hops), "client_cpu_share_of_one_core": round(cpu / wall, 3)}


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
    await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
    if reading.done():
        reading.result()
    return reading


async def _reader_here(kafka: KafkaSettings, topic: str, records: int) -> Reading:
    reading = await _positioned(kafka, topic, records)

    async def hops() -> tuple[list[float], float]:
        try:
            return await reading, 0.0  # its CPU is this process's
        finally:
            reading.cancel()

    return asyncio.create_task(hops())


async def _reader_process(kafka: KafkaSettings, topic: str, records: int) -> Reading:
    """The reader in a child process (``python -m bench.kafka_hop``), returned once it is positioned."""
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.kafka_hop", topic, str(records), kafka.model_dump_json(),
        stdout=asyncio.subprocess.PIPE)
    assert child.stdout is not None
    if (await child.stdout.readline()).strip() != b"ready":
        await child.wait()
        raise RuntimeError(f"the reader process failed before it was positioned (exit {child.returncode})")

    async def hops() -> tuple[list[float], float]:
        try:
            out, _ = await child.communicate()
        finally:
            if child.returncode is None:
                child.kill()
        if child.returncode:
            raise RuntimeError(f"the reader process failed (exit {child.returncode})")
        answer = json.loads(out)
        return answer["hops"], answer["cpu_s"]

    return asyncio.create_task(hops())


async def _child(topic: str, records: int, kafka: KafkaSettings) -> None:
    reading = await _positioned(kafka, topic, records)
    print("ready", flush=True)
    cpu_start = time.process_time()
    hops = await reading
    print(json.dumps({"hops": hops, "cpu_s": time.process_time() - cpu_start}), flush=True)


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
