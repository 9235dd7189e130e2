"""The load generator: streams chat completions against any OpenAI-compatible base URL and times every token.

Per request: TTFT, the gaps between content chunks (ITL), TPOT ((e2e - ttft) / (tokens - 1)), end-to-end latency,
output tokens (from the server's usage when it reports it). Per run: request and output-token throughput, errors by
status code, p50/p90/p99 of each latency. Requests start at a fixed concurrency or with Poisson arrivals; a run
interrupted with Ctrl-C keeps what it measured.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import urlparse

import httpx
import orjson

from bench.common import percentiles
from bench.workload import Item, Shape, WorkloadError, arrivals, items


@dataclass
class RequestResult:
    index: int
    ok: bool
    status: int | None = None
    error: str | None = None
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int | None = None
    #: bytes of content text received, as sent (JSON-escaped); counted by the lean client (``sse_client.py``)
    content_bytes: int = 0
    #: seconds from the run's start to this request's start (timelines)
    started_at: float = 0.0

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


@dataclass(frozen=True)
class Target:
    base_url: str
    model: str
    api_key: str = "none"
    ignore_eos: bool = True
    label: str = ""

    def validate(self) -> None:
        url = urlparse(self.base_url)
        if url.scheme not in ("http", "https") or not url.netloc:
            raise WorkloadError(f"--base-url must be an http(s) URL such as http://127.0.0.1:8000/v1, "
                                f"got {self.base_url!r}")


def _body(target: Target, item: Item) -> bytes:
    return orjson.dumps({
        "model": target.model,
        "messages": [{"role": "user", "content": item.prompt}],
        "max_tokens": item.max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": target.ignore_eos,
    })


async def one(client: httpx.AsyncClient, target: Target, item: Item, run_start: float = 0.0) -> RequestResult:
    started = time.perf_counter()
    result = RequestResult(item.index, ok=False, started_at=started - run_start if run_start else 0.0)
    last: float | None = None
    chunks = 0
    try:
        async with client.stream("POST", "/chat/completions", content=_body(target, item),
                                 headers={"Authorization": f"Bearer {target.api_key}",
                                          "Content-Type": "application/json"}) as response:
            result.status = response.status_code
            if response.status_code != 200:
                result.error = (await response.aread()).decode(errors="replace")[:300]
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = orjson.loads(line[6:])
                if "error" in chunk:
                    result.error = str(chunk["error"])[:300]
                    return result
                usage = chunk.get("usage")
                if usage:
                    result.output_tokens = usage["completion_tokens"]
                    result.prompt_tokens = usage["prompt_tokens"]
                choices = chunk.get("choices") or []
                if choices and choices[0].get("delta", {}).get("content"):
                    now = time.perf_counter()
                    chunks += 1
                    if last is None:
                        result.ttft = now - started
                    else:
                        result.itl.append(now - last)
                    last = now
        result.e2e = time.perf_counter() - started
        result.output_tokens = result.output_tokens or chunks
        result.ok = True
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:300]
    return result


@dataclass
class Run:
    target: Target
    shape: Shape
    concurrency: int | None
    rate: float | None
    results: list[RequestResult] = field(default_factory=list)
    wall_s: float = 0.0
    interrupted: bool = False

    def summary(self) -> dict[str, Any]:
        good = [r for r in self.results if r.ok]
        tokens = sum(r.output_tokens for r in good)
        errors = Counter(str(r.status) if r.status else "connection" for r in self.results if not r.ok)
        return {
            "label": self.target.label,
            "base_url": self.target.base_url,
            "concurrency": self.concurrency,
            "rate": self.rate,
            "requests": len(self.results),
            "completed": len(good),
            "errors": dict(errors),
            "interrupted": self.interrupted,
            "wall_s": round(self.wall_s, 3),
            "request_throughput": round(len(good) / self.wall_s, 3) if self.wall_s else None,
            "output_tokens": tokens,
            "output_tokens_per_s": round(tokens / self.wall_s, 2) if self.wall_s else None,
            "ttft_s": percentiles([r.ttft for r in good if r.ttft is not None]),
            "itl_s": percentiles([gap for r in good for gap in r.itl]),
            "tpot_s": percentiles([t for r in good if (t := r.tpot) is not None]),
            "e2e_s": percentiles([r.e2e for r in good if r.e2e is not None]),
        }

    def as_json(self) -> dict[str, Any]:
        return {"shape": asdict(self.shape), "summary": self.summary(),
                "requests": [asdict(r) | {"tpot": r.tpot} for r in self.results]}


def plan(target: Target, shape: Shape, *, concurrency: int | None = None, rate: float | None = None) -> Run:
    """Validate everything up front (clear messages, nothing sent) and return an empty run to fill."""
    target.validate()
    shape.validate()
    if (concurrency is None) == (rate is None):
        raise WorkloadError("give exactly one of --concurrency or --rate")
    if concurrency is not None and not 1 <= concurrency <= 10_000:
        raise WorkloadError("--concurrency must be between 1 and 10000")
    if rate is not None and not 0 < rate <= 10_000:
        raise WorkloadError("--rate must be between 0 and 10000 requests per second")
    return Run(target, shape, concurrency, rate)


async def run_load(run: Run, progress: Callable[[int], None] | None = None) -> Run:
    """Fill ``run``. Results are appended as requests finish, so an interrupted run keeps what it measured."""
    target, shape, concurrency, rate = run.target, run.shape, run.concurrency, run.rate
    work = items(shape)
    limit = asyncio.Semaphore(concurrency or len(work))
    timeout = httpx.Timeout(600.0, connect=10.0)
    limits = httpx.Limits(max_connections=(concurrency or len(work)) + 8, max_keepalive_connections=256)
    started = time.perf_counter()
    async with httpx.AsyncClient(base_url=target.base_url, timeout=timeout, limits=limits) as client:

        async def go(item: Item) -> None:
            async with limit:
                run.results.append(await one(client, target, item, started))
                if progress is not None:
                    progress(len(run.results))

        tasks: list[asyncio.Task[None]] = []
        try:
            gaps = arrivals(rate, shape.seed)
            for item in work:
                await asyncio.sleep(next(gaps))
                tasks.append(asyncio.create_task(go(item)))
            await asyncio.gather(*tasks)
        except asyncio.CancelledError:
            run.interrupted = True
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        finally:
            run.wall_s = time.perf_counter() - started
    return run
