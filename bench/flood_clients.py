"""The two clients of ``kns bench flood``, each a process of its own: the victim's streams and the attacker's flood.

``python -m bench.flood_clients victim|attacker JSON`` pins itself to ``cpus`` and lowers its own priority (its
threads and its session's autogroup, ``nice``) before it sends anything, so that the benchmark decides which side
of the two cores each client may take (``bench/tenant_flood.py``). Both write their result as one JSON line on
stdout; the attacker first writes ``flooding`` once its connections are sending, and floods until SIGTERM.

* **victim**: ``streams`` streamed chat completions, ``concurrency`` at a time, each timed as its bytes arrive
  (``bench.sse_client``: TTFT, the gaps between content chunks).
* **attacker**: ``connections`` keep-alive HTTP/1.1 connections, raw (a general client spends more CPU than the
  gateway it floods), sending between them ``rate`` requests a second (0: each the next as soon as the last is
  answered), the kinds in turn (:data:`KINDS`). A resume answered 200 is dropped at once (the connection closed
  after its status line): what a client that rewinds a feed and walks away costs.
* **drain**: the attacker's key, as fast as answered, until its reads and its writes are refused (its buckets
  empty): resumes of a stream nobody has and metadata updates, the cheapest of each. Not measured.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import urlparse

import orjson

from bench.common import percentiles

#: what the attacker sends, in turn: resumes of its recent and of its oldest streams, four list reads (a filter that
#: matches nothing, the conversations, one conversation's items, 93 days of usage), conversation writes
KINDS = ("resume recent", "resume far", "list completions", "list conversations", "list items", "usage 93 days",
         "create conversation", "update metadata")
READS = KINDS[:6]
WRITES = KINDS[6:]
#: items of each conversation the attacker creates, and the characters of each
CREATE_ITEMS, ITEM_CHARS = 20, 500


@dataclass(frozen=True)
class Targets:
    """What the attacker's requests name: its own streams (ids), one conversation of its own."""

    recent_streams: list[str]
    far_streams: list[str]
    conversation_id: str


def requests_of(base_url: str, api_key: str, targets: Targets) -> dict[str, list[bytes]]:
    """Each kind's HTTP/1.1 requests, ready to write (a kind naming several streams has one per stream)."""
    url = urlparse(base_url)
    v1 = url.path.rstrip("/")
    end = datetime.now(UTC).replace(microsecond=0)
    start = end - timedelta(days=93)
    items = [{"type": "message", "role": "user" if i % 2 == 0 else "assistant",
              "content": (f"item {i} " + "flood " * ITEM_CHARS)[:ITEM_CHARS]} for i in range(CREATE_ITEMS)]

    def request(method: str, path: str, body: Any = None) -> bytes:
        payload = b"" if body is None else orjson.dumps(body)
        head = (f"{method} {v1}{path} HTTP/1.1\r\nHost: {url.netloc}\r\nAuthorization: Bearer {api_key}\r\n"
                f"Content-Length: {len(payload)}\r\n")
        if body is not None:
            head += "Content-Type: application/json\r\n"
        return (head + "\r\n").encode() + payload

    def resumes(ids: list[str]) -> list[bytes]:
        return [request("GET", f"/chat/completions/{i}?stream=true&starting_after=0") for i in ids]

    conversation = targets.conversation_id
    return {
        "resume recent": resumes(targets.recent_streams),
        "resume far": resumes(targets.far_streams),
        "list completions": [request("GET", "/chat/completions?limit=20&metadata%5Bflood%5D=nothing-matches")],
        "list conversations": [request("GET", "/conversations?limit=20")],
        "list items": [request("GET", f"/conversations/{conversation}/items?limit=20")],
        "usage 93 days": [request("GET", f"/usage?start={int(start.timestamp())}&end={int(end.timestamp())}"
                                         "&group_by=day")],
        "create conversation": [request("POST", "/conversations", {"metadata": {"flood": "yes"}, "items": items})],
        "update metadata": [request("POST", f"/conversations/{conversation}",
                                    {"metadata": {"flood": f"update {n}"}}) for n in range(8)],
    }


def drain_requests(base_url: str, api_key: str, conversation_id: str) -> dict[str, list[bytes]]:
    """A read (a resume of a stream nobody has: 404 once admitted) and a write (a metadata update), in turn."""
    flood = requests_of(base_url, api_key, Targets([f"chatcmpl-drain{n}" for n in range(8)], [], conversation_id))
    return {"resume recent": flood["resume recent"], "update metadata": flood["update metadata"]}


#: refusals in a row, of reads and of writes each, that say the attacker's buckets are empty
REFUSED_IN_A_ROW = 16


@dataclass
class Tally:
    """The attacker's answers: per kind, each status's count (``connection`` for a broken one) and the latency."""

    statuses: dict[str, Counter[str]] = field(default_factory=lambda: {k: Counter() for k in KINDS})
    latency_s: dict[str, list[float]] = field(default_factory=lambda: {k: [] for k in KINDS})
    #: 429s in a row of reads and of writes
    refused_in_a_row: Counter[str] = field(default_factory=Counter)

    def add(self, kind: str, status: str, seconds: float) -> None:
        self.statuses[kind][status] += 1
        self.latency_s[kind].append(seconds)
        side = "writes" if kind in WRITES else "reads"
        self.refused_in_a_row[side] = self.refused_in_a_row[side] + 1 if status == "429" else 0

    def drained(self) -> bool:
        return min(self.refused_in_a_row["reads"], self.refused_in_a_row["writes"]) >= REFUSED_IN_A_ROW

    def as_json(self, wall_s: float) -> dict[str, Any]:
        return {kind: {"sent": sum(counts.values()), "per_s": round(sum(counts.values()) / wall_s, 1),
                       "statuses": dict(sorted(counts.items())),
                       "latency_s": percentiles(self.latency_s[kind])}
                for kind, counts in self.statuses.items()}


class Flood:
    """``connections`` connections sending ``rate`` requests a second between them (0: as fast as answered)."""

    def __init__(self, base_url: str, requests: dict[str, list[bytes]], *, connections: int, rate: float,
                 until_drained: bool = False) -> None:
        url = urlparse(base_url)
        self._host, self._port = url.hostname or "127.0.0.1", url.port or 80
        # The kinds in turn, and each kind's requests (its streams) in turn: every kind gets an equal share
        cycles = {kind: itertools.cycle(sent) for kind, sent in requests.items()}
        self._next = ((kind, next(cycles[kind])) for kind in itertools.cycle(cycles))
        self._until_drained = until_drained
        self._connections = connections
        self._interval = connections / rate if rate > 0 else 0.0
        self.tally = Tally()
        self.stop = asyncio.Event()
        self.sending = asyncio.Event()

    async def run(self) -> float:
        """Floods until ``stop`` is set; the seconds it flooded."""
        started = time.perf_counter()
        tasks = [asyncio.ensure_future(self._connection(i)) for i in range(self._connections)]
        try:
            await self.stop.wait()
            # Each connection ends after the answer it waits for; one stuck is not waited for
            await asyncio.wait(tasks, timeout=5)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return time.perf_counter() - started

    async def _connection(self, index: int) -> None:
        streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        # 1. Spread the connections' first requests over one interval: an even rate from the start
        next_at = time.perf_counter() + self._interval * index / self._connections
        try:
            while not self.stop.is_set():
                # 2. Pace: one request per interval, never a burst to catch up after a slow answer
                if self._interval:
                    now = time.perf_counter()
                    if next_at > now:
                        await asyncio.sleep(next_at - now)
                    next_at = max(next_at + self._interval, time.perf_counter() - self._interval)
                kind, request = next(self._next)
                # 3. One request on the kept-alive connection (a new one after a drop or a close)
                if streams is None:
                    try:
                        streams = await asyncio.open_connection(self._host, self._port)
                    except OSError:
                        self.tally.add(kind, "connection", 0.0)
                        await asyncio.sleep(0.05)
                        continue
                keep = await self._send(streams, kind, request)
                self.sending.set()
                if self._until_drained and self.tally.drained():
                    self.stop.set()
                if not keep:
                    streams[1].close()
                    streams = None
        finally:
            if streams is not None:
                streams[1].close()

    async def _send(self, streams: tuple[asyncio.StreamReader, asyncio.StreamWriter], kind: str,
                    request: bytes) -> bool:
        """Sends ``request`` and counts its answer; whether the connection can carry the next one."""
        reader, writer = streams
        started = time.perf_counter()
        try:
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head[9:12])
            lower = head.lower()
            if status == 200 and kind.startswith("resume"):
                self.tally.add(kind, "200", time.perf_counter() - started)
                return False  # dropped at once, mid-stream
            if b"content-length:" not in lower:
                self.tally.add(kind, str(status), time.perf_counter() - started)
                return False  # a body we do not frame: the connection is given up
            length = int(lower.split(b"content-length:")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
            self.tally.add(kind, "connection", time.perf_counter() - started)
            return False
        self.tally.add(kind, str(status), time.perf_counter() - started)
        return b"connection: close" not in lower


async def attack(config: dict[str, Any]) -> dict[str, Any]:
    targets = Targets(config["recent_streams"], config["far_streams"], config["conversation_id"])
    requests = requests_of(config["base_url"], config["api_key"], targets)
    flood = Flood(config["base_url"], {kind: requests[kind] for kind in config.get("kinds") or KINDS},
                  connections=config["connections"], rate=config["rate"])
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, flood.stop.set)
    running = asyncio.ensure_future(flood.run())
    sending = asyncio.ensure_future(flood.sending.wait())
    await asyncio.wait([running, sending], return_when=asyncio.FIRST_COMPLETED)
    sending.cancel()
    _line(b"flooding")
    wall = await running
    return {"wall_s": round(wall, 3), "cpu_s": round(time.process_time(), 3), "kinds": flood.tally.as_json(wall)}


async def victim(config: dict[str, Any]) -> dict[str, Any]:
    from bench.sse_client import stream

    body = {"model": config["model"], "messages": [{"role": "user", "content": "Tell me a story."}],
            "max_tokens": config["max_tokens"], "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": True}
    limit = asyncio.Semaphore(config["concurrency"])
    run_start = time.perf_counter()

    async def one(index: int) -> dict[str, Any]:
        async with limit:
            result = await stream(config["base_url"], config["api_key"], body, index, run_start)
        return {"ok": result.ok, "status": result.status, "error": result.error, "ttft": result.ttft,
                "itl": result.itl, "output_tokens": result.output_tokens, "started_at": result.started_at}

    results = await asyncio.gather(*(one(i) for i in range(config["streams"])))
    return {"wall_s": round(time.perf_counter() - run_start, 3), "cpu_s": round(time.process_time(), 3),
            "results": list(results)}


async def drain(config: dict[str, Any]) -> dict[str, Any]:
    flood = Flood(config["base_url"], drain_requests(config["base_url"], config["api_key"], config["conversation_id"]),
                  connections=config["connections"], rate=0, until_drained=True)
    wall = await asyncio.wait_for(flood.run(), config.get("timeout_s", 300))
    kinds = flood.tally.as_json(wall)
    return {"wall_s": round(wall, 3), "kinds": {k: v for k, v in kinds.items() if v["sent"]}}


ROLES = {"victim": victim, "attacker": attack, "drain": drain}


def place(cpus: list[int], nice: int) -> None:
    """This process on ``cpus`` (empty: anywhere), its thread and its session's autogroup at ``nice``."""
    if cpus:
        os.sched_setaffinity(0, cpus)
    if nice > 0:
        from runtime.cpu_priority import renice, yield_session

        renice(os.getpid(), nice)
        if os.getsid(0) == os.getpid():  # the benchmark starts each client leading a session of its own
            yield_session(os.getpid(), nice)


def _line(data: bytes) -> None:
    sys.stdout.buffer.write(data + b"\n")
    sys.stdout.buffer.flush()


def main() -> None:
    import uvloop

    role, raw = sys.argv[1], sys.argv[2]
    config = orjson.loads(raw)
    place(config.get("cpus", []), config.get("nice", 0))
    with contextlib.suppress(KeyboardInterrupt):
        _line(orjson.dumps(uvloop.run(ROLES[role](config))))


if __name__ == "__main__":
    main()
