"""The Kafka produce → consume hop on this machine, and what the consumer's fetch wait costs in CPU.

A producer sends one small record at a time (a token event's size) to a fresh topic; a manually assigned consumer
reads it; the hop is consume time minus the timestamp the producer put in the record. Repeated for several
``fetch_max_wait_ms`` values: a long poll returns as soon as a record arrives, so a short wait buys no latency but
makes an idle consumer re-poll the broker all the time. Process CPU time (this process: both clients) is reported.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from aiokafka import TopicPartition
from aiokafka.admin import NewTopic

from bench.common import percentiles
from runtime.kafka_clients import make_admin, make_consumer, make_producer
from runtime.settings import KafkaSettings


async def _one_setting(kafka: KafkaSettings, topic: str, fetch_wait_ms: int, records: int, gap_s: float
                       ) -> dict[str, Any]:
    settings = kafka.model_copy(update={"fetch_max_wait_ms": fetch_wait_ms})
    producer = make_producer(settings, role="bench-hop")
    consumer = make_consumer(settings, role="bench-hop", isolation="read_uncommitted")
    await producer.start()
    await consumer.start()
    tp = TopicPartition(topic, 0)
    consumer.assign([tp])
    await consumer.seek_to_end(tp)
    await consumer.position(tp)
    hops: list[float] = []
    payload = b"x" * 120

    async def read() -> None:
        while len(hops) < records:
            batch = await consumer.getmany(tp, timeout_ms=1000)
            now = time.time_ns()
            for record in batch.get(tp, []):
                sent_ns = int.from_bytes(record.value[:8], "big")
                hops.append((now - sent_ns) / 1e9)

    reader = asyncio.create_task(read())
    cpu_start, wall_start = time.process_time(), time.perf_counter()
    try:
        for _ in range(records):
            await producer.send_and_wait(topic, time.time_ns().to_bytes(8, "big") + payload, partition=0)
            await asyncio.sleep(gap_s)
        await asyncio.wait_for(reader, 30)
        wall = time.perf_counter() - wall_start
        cpu = time.process_time() - cpu_start
    finally:
        reader.cancel()
        await consumer.stop()
        await producer.stop()
    return {"fetch_max_wait_ms": fetch_wait_ms, "records": len(hops), "hop_s": percentiles(hops),
            "client_cpu_share_of_one_core": round(cpu / wall, 3)}


async def run(kafka: KafkaSettings, waits: list[int], records: int, gap_s: float) -> list[dict[str, Any]]:
    topic = f"bench-hop-{uuid.uuid4().hex[:8]}"
    admin = make_admin(kafka)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, 1, 1)])
        return [await _one_setting(kafka, topic, wait, records, gap_s) for wait in waits]
    finally:
        await admin.delete_topics([topic])
        await admin.close()
