"""Export and reconcile on a usage topic of 100k events: do they finish in seconds?

Runs in its own topic namespace and keyspace (created, then deleted): 1. produce N synthetic usage events,
2. export them to Parquet and to CSV, 3. reconcile against an empty ledger (replay + diff), 4. repair (writes every
ledger row), 5. reconcile again against the full ledger. Each step is timed.
"""

from __future__ import annotations

import asyncio
import random
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

from billing.export import write
from billing.ledger import Ledger
from billing.prices import PriceBook, load_seed
from billing.reconcile import reconcile
from billing.replay import replay_usage
from ops.stack.provision import apply_schema
from runtime.cassandra_client import connect_async
from runtime.kafka_clients import ensure_topics, make_admin, make_producer
from runtime.redis_client import make_redis
from runtime.settings import Settings
from runtime.spend import SpendBook
from schemas.codec import codec_for
from schemas.events import UsageEvent
from schemas.topics import TOPICS

T = TypeVar("T")
MODEL = "SmolLM2-135M-Instruct"


def synthetic_usage(n: int, start: datetime, seed: int = 7) -> list[UsageEvent]:
    rng = random.Random(seed)
    orgs = [f"org-{i}" for i in range(20)]
    events = []
    for i in range(n):
        at = start + timedelta(seconds=i * 3600 / n)
        org = rng.choice(orgs)
        prompt = rng.randint(10, 800)
        events.append(UsageEvent(
            request_id=f"bench-{i:07d}", org_id=org, key_id=f"{org}-key{rng.randint(0, 2)}", tier="pro",
            model=MODEL, prompt_tokens=prompt, completion_tokens=rng.randint(1, 400),
            cached_tokens=rng.randint(0, prompt // 2), finish_reason="stop", attempt=1, worker_id="bench",
            requested_at=at, started_at=at, finished_at=at + timedelta(seconds=1)))
    return events


async def timed(steps: dict[str, float], name: str, call: Callable[[], Awaitable[T]]) -> T:
    started = time.perf_counter()
    result = await call()
    steps[name] = round(time.perf_counter() - started, 3)
    return result


async def run(settings: Settings, n: int, report: Callable[[str], None]) -> dict[str, Any]:
    run_id = uuid.uuid4().hex[:6]
    kafka = settings.kafka.model_copy(update={"namespace": f"bench{run_id}"})
    cassandra = settings.cassandra.model_copy(update={"keyspace": f"kns_bench_{run_id}"})
    # The repair charges what it bills to the orgs' spend: in keys of the run's own (they expire with their month)
    redis_settings = settings.redis.model_copy(update={"key_prefix": f"kns-bench{run_id}:"})
    redis = make_redis(redis_settings)
    spend = SpendBook(redis, redis_settings)
    steps: dict[str, float] = {}
    start = datetime.now(UTC).replace(microsecond=0) - timedelta(hours=2)
    end = start + timedelta(hours=1, seconds=1)
    await ensure_topics(kafka, [TOPICS.usage])
    await asyncio.to_thread(apply_schema, cassandra)
    cluster, session = await connect_async(cassandra)
    try:
        events = synthetic_usage(n, start)
        report(f"producing {n} usage events")

        async def produce() -> None:
            producer = make_producer(kafka.model_copy(update={"producer_linger_ms": 20}), role="bench")
            await producer.start()
            codec, topic = codec_for(UsageEvent), kafka.topic(TOPICS.usage.name)
            try:
                for event in events:
                    await producer.send(topic, codec.encode(event), key=event.request_id.encode())
                await producer.flush()
            finally:
                await producer.stop()

        await timed(steps, "produce", produce)
        with tempfile.TemporaryDirectory() as tmp:
            report("export: replay + Parquet")
            replay = await timed(steps, "replay", lambda: replay_usage(kafka, start, end))
            assert len(replay.first) == n, f"replayed {len(replay.first)} of {n}"
            steps["export_parquet_write"] = _time(lambda: write(replay, Path(tmp) / "u.parquet", "parquet"))
            steps["export_csv_write"] = _time(lambda: write(replay, Path(tmp) / "u.csv", "csv"))
        ledger = await Ledger.open(session, cassandra.keyspace)
        prices = PriceBook(load_seed())
        report("reconcile against the empty ledger")
        empty = await timed(steps, "reconcile_empty_ledger", lambda: _reconcile(kafka, ledger, prices, start, end,
                                                                                  repair=False))
        report(f"repair: writing {n} ledger rows")
        repaired = await timed(steps, "repair", lambda: _reconcile(kafka, ledger, prices, start, end, repair=True,
                                                                   spend=spend))
        report("reconcile against the full ledger")
        clean = await timed(steps, "reconcile_full_ledger", lambda: _reconcile(kafka, ledger, prices, start, end,
                                                                                 repair=False))
        return {
            "events": n,
            "seconds": steps,
            "export_seconds": {"parquet": round(steps["replay"] + steps["export_parquet_write"], 3),
                               "csv": round(steps["replay"] + steps["export_csv_write"], 3)},
            "discrepancies": {"empty_ledger": len(empty.discrepancies), "after_repair": len(clean.discrepancies),
                              "repaired": repaired.repaired},
            "ledger_rows_per_second_repair": round(n / steps["repair"]),
        }
    finally:
        await redis.aclose()
        await asyncio.to_thread(cluster.shutdown)
        admin = make_admin(kafka)
        await admin.start()
        try:
            await admin.delete_topics([kafka.topic(TOPICS.usage.name)])
        finally:
            await admin.close()
        await _drop_keyspace(settings, cassandra.keyspace)


async def _reconcile(kafka: Any, ledger: Ledger, prices: PriceBook, start: datetime, end: datetime, *,
                     repair: bool, spend: SpendBook | None = None) -> Any:
    replay = await replay_usage(kafka, start, end)
    return await reconcile(ledger, prices, replay, start, end, repair=repair, spend=spend)


def _time(call: Callable[[], object]) -> float:
    started = time.perf_counter()
    call()
    return round(time.perf_counter() - started, 3)


async def _drop_keyspace(settings: Settings, keyspace: str) -> None:
    cluster, session = await connect_async(settings.cassandra)
    try:
        await asyncio.to_thread(session.execute, f"DROP KEYSPACE IF EXISTS {keyspace}", timeout=120)
    finally:
        await asyncio.to_thread(cluster.shutdown)
