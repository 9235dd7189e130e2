"""Token transport, measured: Kafka records and bytes per generated token, one record per delta vs one per step.

A stack of its own (``bench/chaos``: one worker, one gateway, a Redis of its own) per record version: v2 writes one
record per request per engine step (what workers wrote before TokenEvent v3), v3 one record per step per reply
partition (``inference_workers/token_sink.py``). At each concurrency, ``rounds`` waves of ``c`` streams of
``tokens`` tokens go through the gateway (every stream checked complete); the token topic's records written meanwhile
are then read back: records, payload bytes (key + value + headers) and the tokens and deltas they carry. The
synthetic engine steps every running request at once (as vLLM's batch does); ``--vllm`` adds the real engine at the
low concurrencies. Both versions run in one invocation, the same load, one after the other.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from aiokafka import TopicPartition

from bench.chaos.client import Load
from bench.chaos.environment import ChaosEnv, Knobs, Ports
from bench.common import percentiles
from runtime.kafka_clients import all_partitions, make_consumer
from runtime.settings import KafkaSettings, Settings
from schemas.codec import codec_for
from schemas.errors import DecodeError
from schemas.events import TokenEvent
from schemas.topics import TOPICS

Say = Callable[[str], None]
Offsets = dict[TopicPartition, int]


async def end_offsets(kafka: KafkaSettings) -> Offsets:
    consumer = make_consumer(kafka, role="bench-transport")
    await consumer.start()
    try:
        return dict(await consumer.end_offsets(await all_partitions(consumer, kafka.topic(TOPICS.tokens.name))))
    finally:
        await consumer.stop()


async def records_between(kafka: KafkaSettings, start: Offsets, end: Offsets) -> dict[str, int]:
    """What the token topic holds between two sets of end offsets: records, payload bytes, deltas, tokens."""
    codec = codec_for(TokenEvent)
    consumer = make_consumer(kafka, role="bench-transport-read", isolation="read_uncommitted",
                             max_partition_fetch_bytes=8 * 1024 * 1024)
    await consumer.start()
    totals = {"records": 0, "bytes": 0, "deltas": 0, "tokens": 0, "finals": 0}
    try:
        todo = {tp: stop for tp, stop in end.items() if stop > start.get(tp, 0)}
        consumer.assign(list(todo))
        for tp in todo:
            consumer.seek(tp, start.get(tp, 0))
        while todo:
            batch = await consumer.getmany(*todo, timeout_ms=1000)
            for tp, records in batch.items():
                for record in records:
                    if record.offset >= todo.get(tp, -1):
                        continue
                    totals["records"] += 1
                    totals["bytes"] += len(record.key or b"") + len(record.value or b"") + sum(
                        len(k) + len(v) for k, v in record.headers or ())
                    try:
                        events = codec.decode(record.value or b"").split()
                    except DecodeError:
                        continue
                    totals["deltas"] += len(events)
                    totals["tokens"] += sum(len(e.token_ids) for e in events)
                    totals["finals"] += sum(1 for e in events if e.is_final)
            for tp in list(todo):
                if await consumer.position(tp) >= todo[tp]:
                    del todo[tp]
    finally:
        await consumer.stop()
    return totals


async def one_level(env: ChaosEnv, settings: Settings, *, concurrency: int, rounds: int, tokens: int
                    ) -> dict[str, Any]:
    kafka = env.kafka()
    before = await end_offsets(kafka)  # type: ignore[arg-type]
    load = Load(env.base_urls, env.api_key, settings.model.served_name, requests=concurrency * rounds,
                concurrency=concurrency, max_tokens=tokens, label=f"transport-c{concurrency}")
    started = time.monotonic()
    streams = await load.run()
    wall = time.monotonic() - started
    after = await end_offsets(kafka)  # type: ignore[arg-type]
    totals = await records_between(kafka, before, after)  # type: ignore[arg-type]
    completed = sum(1 for s in streams if s.completed)
    toks = max(1, totals["tokens"])
    return {
        "concurrency": concurrency, "streams": len(streams), "completed": completed, **totals,
        "records_per_token": round(totals["records"] / toks, 4),
        "bytes_per_token": round(totals["bytes"] / toks, 1),
        "deltas_per_record": round(totals["deltas"] / max(1, totals["records"]), 2),
        "output_tokens_per_s": round(totals["tokens"] / wall, 1),
        "ttft_s": percentiles([s.chunk_times[0] - s.started for s in streams if s.chunk_times]),
        "wall_s": round(wall, 2),
    }


async def one_version(settings: Settings, *, version: int, engine: str, levels: list[int], rounds: int,
                      tokens: int, port_base: int, say: Say) -> list[dict[str, Any]]:
    knobs = Knobs(engine=engine, max_seqs=max(16, *levels), tokens_per_s=20.0,
                  extra={"KNS_WORKER__TOKEN_RECORD_VERSION": str(version)})
    env = ChaosEnv(settings, Ports(port_base), knobs)
    out = []
    try:
        await env.start(workers=1)
        for c in levels:
            row = await one_level(env, settings, concurrency=c, rounds=rounds, tokens=tokens)
            out.append({"version": version, "engine": engine, **row})
            say(f"{engine} v{version} c={c}: {row['records_per_token']} records/token, "
                f"{row['bytes_per_token']} B/token, {row['completed']}/{row['streams']} completed")
    finally:
        await env.stop()
    return out


async def run(settings: Settings, *, levels: list[int], vllm_levels: list[int], rounds: int, tokens: int,
              port_base: int, say: Say) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    for version in (2, 3):
        rows += await one_version(settings, version=version, engine="synthetic", levels=levels, rounds=rounds,
                                  tokens=tokens, port_base=port_base, say=say)
    for version in (2, 3) if vllm_levels else ():
        rows += await one_version(settings, version=version, engine="vllm", levels=vllm_levels, rounds=rounds,
                                  tokens=tokens, port_base=port_base, say=say)
    return {"tokens_per_stream": tokens, "rounds": rounds, "synthetic_tokens_per_s": 20.0, "rows": rows}
