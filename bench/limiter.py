"""What the key check and the rate limiter cost a request, on the running stack's Kafka, Cassandra and Redis.

1. In process, the real classes side by side in one run: the key check (the registry view's lookup + the
   suspension list in Redis) and the admission (one Lua script on Redis, then the release of the in-flight slot)
   per request, sequentially (latency p50/p99) and from many tasks at once (admissions per second of one
   process, one core).
2. Through HTTP, one gateway process with the synthetic engine: requests per second it answers when each request
   is refused at the limit (HTTP + key check + limiter, nothing produced) and when each is admitted and answered
   (one token, through Kafka and the worker). The load client (a raw keep-alive HTTP client) runs in this process
   and takes CPU from the same two cores: the CPU each side used is reported so that the figures can be read with
   that in mind.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlparse

import orjson

from bench.common import percentiles
from bench.cpu import CpuMeter
from bench.servers import pipeline
from producers.gateway.admission import Admission
from producers.gateway.keys import hash_key
from producers.gateway.local_limiter import LocalLimiter
from producers.tenancy.admin import UNLIMITED, KeyCreate, Limits, open_admin
from runtime.cassandra_client import connect_async
from runtime.kafka_clients import ensure_topics
from runtime.limiter import RateLimiter
from runtime.redis_client import make_redis
from runtime.settings import Settings
from runtime.suspensions import KeySuspensions
from runtime.tenancy import ApiKey, TenancyView
from schemas.topics import TOPICS

Say = Callable[[str], None]


async def _timed(step: Callable[[], Awaitable[object]], n: int) -> list[float]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        await step()
        times.append(time.perf_counter() - t0)
    return times


async def _rate(step: Callable[[], Awaitable[object]], tasks: int, seconds: float) -> float:
    done = 0
    end = time.perf_counter() + seconds

    async def loop() -> None:
        nonlocal done
        while time.perf_counter() < end:
            await step()
            done += 1

    started = time.perf_counter()
    await asyncio.gather(*(loop() for _ in range(tasks)))
    return done / (time.perf_counter() - started)


async def in_process(settings: Settings, namespace: str, *, requests: int, tasks: int, seconds: float,
                     say: Say) -> dict[str, Any]:
    kafka = settings.kafka.model_copy(update={"namespace": namespace})
    async with open_admin(settings.model_copy(update={"kafka": kafka})) as admin:
        issued = await admin.issue_key("org-bench-limits", "enterprise", KeyCreate(name="limits"), limits=UNLIMITED)
    view = TenancyView(kafka, catch_up_timeout_s=settings.tenancy.catch_up_timeout_s)
    await view.start()
    redis = make_redis(settings.redis)
    cluster, session = await connect_async(settings.cassandra)
    try:
        suspensions = await KeySuspensions.open(session, settings.cassandra.keyspace, redis, settings.redis)
        admission = Admission(RateLimiter(redis, settings.redis), LocalLimiter(), settings.tenancy.tiers)
        secret_hash = hash_key(issued.secret)

        async def key_check() -> ApiKey:
            key = await view.authenticate(secret_hash)
            assert isinstance(key, ApiKey)
            await suspensions.reason(key.key_id)
            return key

        key = await key_check()

        tickets = []

        async def admit() -> None:
            tickets.append(await admission.admit(f"bench-{uuid.uuid4().hex}", 300, key))

        async def release() -> None:  # after the answer, off the request's path: measured apart
            await admission.end(tickets.pop())

        async def added() -> None:  # what a request waits for before it is produced
            await key_check()
            await admit()

        async def whole() -> None:
            await added()
            await release()

        async def lookup_only() -> None:
            await view.authenticate(secret_hash)

        say(f"in process: {requests} sequential calls of each step, interleaved")
        await _timed(whole, 200)  # warm the connection pool and the script cache
        latency: dict[str, list[float]] = {"registry lookup": [], "key check": [], "admit": [], "release": [],
                                           "added per request": []}
        for _ in range(10):
            for name, step in (("registry lookup", lookup_only), ("key check", key_check), ("admit", admit),
                               ("release", release), ("added per request", added)):
                latency[name] += await _timed(step, requests // 10)
            while tickets:
                await release()
        say(f"in process: {tasks} tasks at once for {seconds:.0f} s per step")
        rates = {name: await _rate(step, tasks, seconds)
                 for name, step in (("key check", key_check), ("added per request", added),
                                    ("admit + release", whole))}
    finally:
        await view.stop()
        await redis.aclose()
        await asyncio.to_thread(cluster.shutdown)
    return {"latency_s": {name: percentiles(values) for name, values in latency.items()},
            "per_second_one_process": {name: round(rate) for name, rate in rates.items()},
            "requests": requests, "tasks": tasks}


async def _http_rate(url: str, secret: str, *, concurrency: int, seconds: float) -> dict[str, Any]:
    """``concurrency`` keep-alive connections, each sending the next request as soon as the last is answered. A
    raw HTTP/1.1 client: httpx spent more CPU than the gateway it measured (a whole core at 90 requests/s)."""
    target = urlparse(url)
    body = orjson.dumps({"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi"}],
                         "max_tokens": 1, "temperature": 0})
    request = (f"POST {target.path}/chat/completions HTTP/1.1\r\nHost: {target.netloc}\r\n"
               f"Authorization: Bearer {secret}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    statuses: dict[int, int] = {}
    latencies: list[float] = []
    end = time.perf_counter() + seconds

    async def connection() -> None:
        reader, writer = await asyncio.open_connection(target.hostname, target.port)
        try:
            while time.perf_counter() < end:
                t0 = time.perf_counter()
                writer.write(request)
                head = await reader.readuntil(b"\r\n\r\n")
                status = int(head[9:12])
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                latencies.append(time.perf_counter() - t0)
                statuses[status] = statuses.get(status, 0) + 1
        finally:
            writer.close()

    started = time.perf_counter()
    await asyncio.gather(*(connection() for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    return {"per_second": round(sum(statuses.values()) / elapsed), "statuses": statuses,
            "latency_s": percentiles(latencies), "seconds": round(elapsed, 2)}


async def through_http(settings: Settings, namespace: str, *, concurrency: int, seconds: float, port: int,
                       say: Say) -> dict[str, Any]:
    secret, procs = await pipeline(settings, namespace=namespace, gateway_port=port, worker_port=port + 1,
                                   prefix="limits", extra_env={"KNS_ENGINE__KIND": "synthetic",
                                                               "KNS_ENGINE__SYNTHETIC_MAX_SEQS": "256",
                                                               "KNS_ENGINE__SYNTHETIC_TOKENS_PER_S": "1000"})
    kafka = settings.kafka.model_copy(update={"namespace": namespace})
    async with open_admin(settings.model_copy(update={"kafka": kafka})) as admin:
        # One request a minute: after the first, every request is refused at the limit
        refused_secret = (await admin.issue_key(f"org-bench-refused-{namespace}", "enterprise",
                                                KeyCreate(name="refused"),
                                                limits=Limits(requests_per_minute=1, max_concurrent=10**6))).secret
    for proc in procs:
        proc.start()
    try:
        await asyncio.gather(*(proc.wait(300) for proc in procs))
        url = f"http://127.0.0.1:{port}/v1"
        gateway, worker = procs[1], procs[0]
        results: dict[str, Any] = {}
        for name, key in (("refused at the limit", refused_secret), ("admitted and answered", secret)):
            say(f"HTTP: {name}, {concurrency} clients for {seconds:.0f} s")
            await _http_rate(url, key, concurrency=4, seconds=1)  # warm-up
            meter = CpuMeter({"gateway": gateway.pid or 0, "worker": worker.pid or 0, "load client": os.getpid()},
                             alone=frozenset({"load client"}))
            result = await _http_rate(url, key, concurrency=concurrency, seconds=seconds)
            result["cpu_s"] = meter.since()
            results[name] = result
        return results
    finally:
        for proc in procs:
            proc.stop()


async def run(settings: Settings, *, requests: int = 2000, tasks: int = 64, seconds: float = 8.0,
              concurrency: int = 64, port: int = 18300, say: Say = lambda _m: None) -> dict[str, Any]:
    namespace = f"benchlim{uuid.uuid4().hex[:6]}"
    await ensure_topics(settings.kafka.model_copy(update={"namespace": namespace}), TOPICS.all())
    return {
        "namespace": namespace,
        "in_process": await in_process(settings, namespace, requests=requests, tasks=tasks, seconds=seconds,
                                       say=say),
        "http": await through_http(settings, namespace, concurrency=concurrency, seconds=seconds, port=port,
                                   say=say),
    }
