"""What ``GET /v1/usage`` costs the gateway for a busy org's whole window (93 days): its peak memory and answer time.

The org's ledger is seeded straight into Cassandra (``ledger_by_org_day``: ``--per-day`` rows a day, spread over
the window that ends now) and its hourly aggregates are recomputed by ``Ledger.recompute_hour``, as the billing
processor does. Then, for each code tree given (``--code label=path``: the current tree, and e.g. a worktree of an
older commit run with the same virtualenv), one gateway process (``python -m producers.gateway.main``, no
supervisor, in a Kafka namespace of its own) answers the same report ``--calls`` times, one call at a time. The
process's RSS is read from ``/proc`` before the first call (after a warm-up report of one hour) and its peak
(``VmHWM``) after each call; every tree's answer must be the same. The seeded partitions and the namespace's topics
are deleted at the end.

    python -m bench.usage_report --per-day 3000 --code after=. --code before=/tmp/kns-before
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import time
import uuid
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx

from bench.common import percentiles, save
from billing.ledger import Ledger, hour_of
from ops.stack.process import PidFile, spawn, stop
from producers.tenancy.admin import UNLIMITED, KeyCreate, open_admin
from runtime.cassandra_client import connect_async, execute
from runtime.kafka_clients import ensure_topics, make_admin
from runtime.retry import retry_transient
from runtime.settings import REPO_ROOT, KafkaSettings, Settings, load_settings
from schemas.topics import TOPICS

RUN_DIR = REPO_ROOT / ".local" / "bench"
WINDOW = timedelta(days=93)
MODELS = ("SmolLM2-135M-Instruct", "SmolLM2-360M-Instruct")


def _status_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _mb(kb: int) -> float:
    return round(kb / 1024, 1)


async def seed(settings: Settings, org: str, end: datetime, per_day: int, say: Any) -> int:
    """``per_day`` ledger rows a day over the window before ``end``, then every hour's aggregates."""
    cluster, session = await connect_async(settings.cassandra)
    ks = settings.cassandra.keyspace
    try:
        insert = await asyncio.to_thread(
            session.prepare,
            f"INSERT INTO {ks}.ledger_by_org_day (org_id, day, requested_at, request_id, key_id, model, "
            "prompt_tokens, completion_tokens, cached_tokens, cost, price_version, finish_reason) "
            f"VALUES ({', '.join('?' * 12)})")
        start = end - WINDOW
        total = int(WINDOW / timedelta(days=1) * per_day)
        step = WINDOW / total
        semaphore = asyncio.Semaphore(32)

        async def one(n: int) -> None:
            at = start + step * n
            at = at.replace(microsecond=at.microsecond // 1000 * 1000)
            values = [org, at.date(), at, f"chatcmpl-bench{n:09d}", f"key-{n % 4}", MODELS[n % 2], 11 + n % 50,
                      1 + n % 30, n % 8, Decimal(n % 997) / Decimal(10**7), "bench", "stop"]
            async with semaphore:  # an upsert: retried as it is when a loaded node times it out
                await retry_transient(lambda: execute(session, insert, values), what="ledger seed")

        t0 = time.perf_counter()
        for first in range(0, total, 20_000):
            await asyncio.gather(*(one(n) for n in range(first, min(total, first + 20_000))))
            say(f"seeded {min(total, first + 20_000)}/{total} ledger rows ({time.perf_counter() - t0:.0f} s)")
        ledger = await Ledger.open(session, ks)
        hours = [hour_of(start) + timedelta(hours=h) for h in range(int(WINDOW / timedelta(hours=1)) + 2)]
        hour_slots = asyncio.Semaphore(8)

        async def recompute(hour: datetime) -> None:
            async with hour_slots:
                await ledger.recompute_hour(org, hour)

        await asyncio.gather(*(recompute(h) for h in hours))
        say(f"recomputed {len(hours)} hours' aggregates ({time.perf_counter() - t0:.0f} s in all)")
        return total
    finally:
        await asyncio.to_thread(cluster.shutdown)


async def cleanup(settings: Settings, kafka: KafkaSettings, org: str, end: datetime) -> None:
    """The seeded partitions and the namespace's topics go."""
    cluster, session = await connect_async(settings.cassandra)
    ks = settings.cassandra.keyspace
    try:
        day, last = (end - WINDOW).date(), end.date()
        while day <= last:
            for table in ("ledger_by_org_day", "usage_hourly"):
                await execute(session, f"DELETE FROM {ks}.{table} WHERE org_id = %s AND day = %s", (org, day))
            day += timedelta(days=1)
    finally:
        await asyncio.to_thread(cluster.shutdown)
    admin = make_admin(kafka)
    await admin.start()
    try:
        await admin.delete_topics([kafka.topic(t.name) for t in TOPICS.all()])
    finally:
        await admin.close()


async def _healthy(url: str, pid_file: PidFile, log: Path, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=3) as client:
        while time.monotonic() < deadline:
            if pid_file.live_pid() is None:
                raise RuntimeError(f"the gateway exited; see {log}")
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get(url)).status_code == 200:
                    return
            await asyncio.sleep(0.5)
    raise RuntimeError(f"the gateway was not healthy in {timeout_s} s; see {log}")


async def measure(label: str, code: Path, env: dict[str, str], port: int, secret: str, params: dict[str, str],
                  calls: int, say: Any) -> dict[str, Any]:
    pid_file, log = PidFile(RUN_DIR / f"usage-gateway-{label}.pid"), RUN_DIR / f"usage-gateway-{label}.log"
    log.unlink(missing_ok=True)
    spawn([sys.executable, "-m", "producers.gateway.main"], log_file=log, pid_file=pid_file, env=env, cwd=code)
    try:
        await _healthy(f"http://127.0.0.1:{port}/health", pid_file, log)
        pid = pid_file.live_pid()
        assert pid is not None
        headers = {"Authorization": f"Bearer {secret}"}
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}/v1", headers=headers, timeout=900) as http:
            end = datetime.fromisoformat(params["end"])
            warm = await http.get("/usage", params={"start": (end - timedelta(hours=1)).isoformat(),
                                                    "end": params["end"]})
            warm.raise_for_status()
            baseline = {"rss_mb": _mb(_status_kb(pid, "VmRSS")), "peak_rss_mb": _mb(_status_kb(pid, "VmHWM"))}
            runs, answer = [], None
            for n in range(calls):
                t0 = time.perf_counter()
                response = await http.get("/usage", params=params)
                seconds = time.perf_counter() - t0
                run = {"status": response.status_code, "seconds": round(seconds, 3),
                       "peak_rss_mb": _mb(_status_kb(pid, "VmHWM")), "rss_mb_after": _mb(_status_kb(pid, "VmRSS"))}
                if response.status_code == 200:
                    answer = response.json()
                else:  # kept: what an overloaded store answers is part of the measurement
                    run["error"] = response.json().get("error", {}).get("message")
                runs.append(run)
                say(f"{label}: call {n + 1}: {response.status_code} in {seconds:.2f} s, "
                    f"peak RSS {run['peak_rss_mb']} MB")
        answered = [r["seconds"] for r in runs if r["status"] == 200]
        return {"code": str(code), "baseline": baseline, "calls": runs, "answered": len(answered),
                "seconds": percentiles(answered),
                "peak_rss_mb": max(r["peak_rss_mb"] for r in runs),
                "peak_rss_growth_mb": round(max(r["peak_rss_mb"] for r in runs) - baseline["rss_mb"], 1),
                "total": answer["total"] if answer else None, "groups": len(answer["data"]) if answer else None}
    finally:
        stop(pid_file)


async def run(settings: Settings, *, per_day: int, calls: int, codes: dict[str, Path], port: int,
              say: Any) -> dict[str, Any]:
    namespace = f"usagebench{uuid.uuid4().hex[:8]}"
    kafka = settings.kafka.model_copy(update={"namespace": namespace})
    org = f"org-bench-usage-{namespace}"
    end = datetime.now(UTC).replace(microsecond=0)
    await ensure_topics(kafka, TOPICS.all())
    async with open_admin(settings.model_copy(update={"kafka": kafka})) as admin:
        secret = (await admin.issue_key(org, "plus", KeyCreate(name="usage"), limits=UNLIMITED)).secret
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "KNS_KAFKA__NAMESPACE": namespace, "KNS_SAFETY__PREFILTER": "false",
           "KNS_GATEWAY__PORT": str(port), "KNS_GATEWAY__INSTANCE_ID": f"usage-gateway-{namespace}"}
    params = {"start": (end - WINDOW).isoformat(), "end": end.isoformat(), "group_by": "day"}
    try:
        rows = await seed(settings, org, end, per_day, say)
        sides = {label: await measure(label, code, env, port, secret, params, calls, say)
                 for label, code in codes.items()}
    finally:
        await cleanup(settings, kafka, org, end)
    totals = {label: side["total"] for label, side in sides.items() if side["total"] is not None}
    if len({str(t) for t in totals.values()}) != 1:
        raise AssertionError(f"the trees answered differently: {totals}")
    return {"ledger_rows": rows, "per_day": per_day, "days": WINDOW.days, "group_by": "day",
            "calls_each": calls, "sides": sides}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--per-day", type=int, default=3000, help="ledger rows a day (93 days)")
    parser.add_argument("--calls", type=int, default=3, help="reports per tree, one at a time")
    parser.add_argument("--code", action="append", default=[], metavar="LABEL=PATH",
                        help="a code tree to run the gateway from (default: after=the current tree)")
    parser.add_argument("--port", type=int, default=int(os.environ.get("KNS_TEST_PORT_BASE", "18000")) + 80)
    args = parser.parse_args()
    codes = dict((label, Path(path).resolve()) for label, path in (c.split("=", 1) for c in args.code)) or {
        "after": REPO_ROOT}
    result = asyncio.run(run(load_settings(), per_day=args.per_day, calls=args.calls, codes=codes, port=args.port,
                             say=lambda message: print(f"• {message}", file=sys.stderr, flush=True)))
    print(save("usage-report", result))


if __name__ == "__main__":
    main()
