"""One tenant's flood of resumes, list reads and conversation writes, and another tenant's TTFT (issue 37).

Reads and resumes take a read of the key's and the org's read bucket, conversation writes are requests of the key's
limits, a throttled key is refused before any expensive work, a far resume reads on a catch-up consumer of its own:
what the flood costs the gateway past its allowance is the refusals. This measures what that leaves another tenant.

**The stack** is a ``bench/chaos`` one of its own (namespace, Redis, synthetic-engine worker, one gateway; Kafka and
Cassandra the running stack's). The victim is the stack's own enterprise org; each attacker an org of its own at a
normal tier (``tiers``; ``plus``: 600 requests and 600 reads a minute, ``free``: 30 of each), which first makes a
few streams and one conversation of 20 items (what its resumes and item lists name). A ``plus`` attacker gets its
allowance's work done and the rest refused; a ``free`` one almost only refusals: side by side, they tell what the
allowance costs the other tenant from what the refusals do.

**The phases**, ``rounds`` times in turn: the victim alone, then the victim under a flood of each attacker at each of
``rates``. The victim's load is the same each time: ``streams`` streamed chat completions, ``concurrency`` at a
time, ``max_tokens`` each (synthetic engine at ``tokens_per_s`` a stream), timed on the client as each byte arrives
(TTFT, the gaps between content chunks). Before each flood the attacker makes a few new streams (its recent ones;
those of its setup are far behind the feed by then) and spends its buckets (not measured: a flood after a quiet
minute would carry a minute's burst, 600 reads and 600 writes, one after a flood almost nothing), so that every
flood gets the same: what its buckets refill while it lasts (10 reads and 10 writes a second at ``plus``, one every
two seconds at ``free``), the rest refused. It floods from ``connections`` keep-alive connections at the phase's
rate (0: as fast as answered) until the victim is done: the kinds of ``bench/flood_clients.KINDS`` in turn (resumes
of its recent and far streams, dropped at once; its completions filtered on a metadata value nothing has; its
conversations; a conversation's items; 93 days of usage by day; creates of 20-item conversations; metadata updates).

**What is measured** per phase: the victim's TTFT and ITL (p50, p99), its streams completed; the attacker's answers by
kind and status, and its achieved rates; the CPU seconds of the gateway's service process (``/proc``, from the
victim's first request to its last answer), of the worker, the run's Redis, Kafka and Cassandra, and the whole box's
busy cores, and what of them none of these nor the clients used (``rest_cores``: other work on the machine). The
bound (:data:`BOUND_SHARE`, :data:`BOUND_FLOOR_S`) is checked for each flood on the median over the rounds of its
TTFT p99 minus the victim alone's in the same round (:func:`bound`).

**The two cores.** The clients must not take the measured process's CPU: with ``pin`` (and at least two cores) the
gateway's service process runs alone among the processes started here on the last core, both clients on the others
(the worker, Redis, Kafka and Cassandra are not pinned: they serve both tenants, as in production). Each client is a
process of its own, leading a session of its own: the victim's at nice 0, the attacker's (its thread and its session's
autogroup, the level the scheduler weighs first) at nice 19, so that the flood's client takes only CPU nothing else
wants: its achieved rate is reported, never assumed. Each client reports its own CPU seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson

from bench.chaos.environment import ChaosEnv, Knobs, Ports
from bench.common import percentiles
from bench.cpu import CpuMeter
from bench.flood_clients import KINDS, READS, WRITES
from bench.servers import infra_pids, pin_threads
from producers.tenancy.admin import KeyCreate, open_admin
from runtime.settings import Settings

Say = Callable[[str], None]

#: the bound: the flood moves the victim's TTFT p99 (phases pooled) by at most this share of it alone, or by
#: BOUND_FLOOR_S, whichever is larger (why these: docs/PERFORMANCE.md, "One tenant's flood")
BOUND_SHARE = 0.25
BOUND_FLOOR_S = 0.05
#: the clients' nice levels (thread and session autogroup): the attacker's client yields to everything
VICTIM_NICE, ATTACKER_NICE = 0, 19
#: streams the attacker makes before the rounds (its far ones) and before each flood (its recent ones)
ATTACKER_STREAMS = 4
ATTACKER_TOKENS = 8
DRAIN_CONNECTIONS = 2
#: a flood: the attacker's tier, the requests a second it offers
Flood = tuple[str, float]
_TICK = os.sysconf("SC_CLK_TCK")
#: the running stack's services this run shares, metered beside its own (the run's Redis is its own)
SHARED = ("kafka", "cassandra")
METERED = ("gateway", "worker", "redis", *SHARED)


@dataclass(frozen=True)
class FloodShape:
    rounds: int = 3
    streams: int = 120
    concurrency: int = 8
    max_tokens: int = 32
    tokens_per_s: float = 50.0
    connections: int = 32
    #: the floods of each round, one after the other: requests a second the attacker offers, all kinds together
    #: (0: each connection sends as soon as it is answered)
    rates: tuple[float, ...] = (300.0,)
    #: the attackers' tiers (an org each), each flooding at each rate
    tiers: tuple[str, ...] = ("plus", "free")
    #: what the attacker sends (``bench.flood_clients.KINDS``; empty: all, in turn)
    kinds: tuple[str, ...] = ()

    def floods(self) -> list[Flood]:
        return [(tier, rate) for tier in self.tiers for rate in self.rates]


@dataclass(frozen=True)
class Placement:
    """Which cores the gateway's service process and the clients run on (empty: anywhere)."""

    gateway_cpus: tuple[int, ...] = ()
    client_cpus: tuple[int, ...] = ()

    @classmethod
    def split(cls, pin: bool) -> Placement:
        """The last core for the gateway, the others for the clients (nothing pinned on one core or unasked)."""
        cores = sorted(os.sched_getaffinity(0))
        if not pin or len(cores) < 2:
            return cls()
        return cls((cores[-1],), tuple(cores[:-1]))

    def as_json(self) -> dict[str, Any]:
        return {"gateway_cpus": list(self.gateway_cpus), "client_cpus": list(self.client_cpus),
                "victim_nice": VICTIM_NICE, "attacker_nice": ATTACKER_NICE,
                "accounting": "the gateway's service process pinned alone (of the processes this run starts) to "
                              "gateway_cpus, both clients to client_cpus; worker, Redis, Kafka and Cassandra "
                              "unpinned; each client a session of its own, the attacker's thread and autogroup at "
                              "attacker_nice (it takes only idle CPU), the victim's at victim_nice; each client's "
                              "own CPU seconds reported; box_busy_cores shows other work on the machine"
                if self.gateway_cpus else "nothing pinned; clients niced as above"}


def bound(alone: list[list[float]], flood: list[list[float]], *, share: float = BOUND_SHARE,
          floor_s: float = BOUND_FLOOR_S) -> dict[str, Any]:
    """Whether the flood moved the victim's TTFT p99 by at most ``share`` of it alone or ``floor_s``, the larger.

    ``alone`` and ``flood`` hold each round's TTFTs. The move is the median over the rounds of each round's flood p99
    minus its alone p99: on two cores shared with other work, one round that other work disturbs moves a pooled p99
    (its slowest streams are the pool's), not a median of rounds."""
    rounds = [(percentiles(a)["p99"], percentiles(f)["p99"]) for a, f in zip(alone, flood, strict=True)]
    if not rounds or any(a is None or f is None for a, f in rounds):
        return {"holds": False, "why": "a round without a TTFT measured"}
    alone_p99 = [a for a, _ in rounds if a is not None]
    moves = [f - a for a, f in rounds if a is not None and f is not None]
    moved, alone_median = statistics.median(moves), statistics.median(alone_p99)
    allowed = max(share * alone_median, floor_s)
    return {"moved_s": round(moved, 4), "allowed_s": round(allowed, 4), "holds": moved <= allowed,
            "moved_by_round_s": [round(m, 4) for m in moves], "alone_p99_s": round(alone_median, 4),
            "alone_p99_by_round_s": [round(a, 4) for a in alone_p99],
            "flood_p99_by_round_s": [round(f, 4) for _, f in rounds if f is not None],
            "share": share, "floor_s": floor_s}


def answers(kinds: dict[str, dict[str, Any]], names: tuple[str, ...] = KINDS) -> dict[str, int]:
    """The attacker's answers of ``names``, by outcome: admitted (2xx), 429, 404, other."""
    out: Counter[str] = Counter()
    for kind in names:
        for status, count in kinds[kind]["statuses"].items():
            outcome = ("admitted" if status.startswith("2") else status if status in ("429", "404") else "other")
            out[outcome] += count
    return dict(out)


# --- the stack and the attacker's own objects ------------------------------------------------------------------


@dataclass(frozen=True)
class Attacker:
    """An attacking org of ``tier``: its key, the streams it made first (far behind the feed by its floods), a
    conversation of its own."""

    tier: str
    key: str
    far_streams: list[str]
    conversation_id: str

    @classmethod
    async def open(cls, env: ChaosEnv, tier: str) -> Attacker:
        key = await _attacker_key(env, tier)
        return cls(tier, key, await _streams(env, key, ATTACKER_STREAMS), await _conversation(env, key))


async def _attacker_key(env: ChaosEnv, tier: str) -> str:
    async with open_admin(env.settings.model_copy(update={"kafka": env.kafka()})) as admin:
        issued = await admin.issue_key(f"org-flood-{tier}-{env.run_id}", tier, KeyCreate(name="flood"))
    # The gateway follows the registry: the key serves once it has read the record
    async with httpx.AsyncClient(base_url=env.base_url, timeout=5) as client:
        deadline = time.monotonic() + 60
        while (await client.get("/models", headers=_auth(issued.secret))).status_code != 200:
            if time.monotonic() > deadline:
                raise RuntimeError("the gateway did not learn the attacker's key in 60 s")
            await asyncio.sleep(0.2)
    return issued.secret


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def _streams(env: ChaosEnv, key: str, n: int) -> list[str]:
    """``n`` streamed completions of ``key``, read to their end; their ids (what a resume names)."""
    body = {"model": env.settings.model.served_name, "messages": [{"role": "user", "content": "Hi."}],
            "max_tokens": ATTACKER_TOKENS, "stream": True, "ignore_eos": True}
    ids = []
    async with httpx.AsyncClient(base_url=env.base_url, timeout=60) as client:
        for _ in range(n):
            while True:  # its flood may have spent its requests: it waits as Retry-After says
                async with client.stream("POST", "/chat/completions", json=body, headers=_auth(key)) as response:
                    if response.status_code == 429:
                        await response.aread()
                        await asyncio.sleep(float(response.headers.get("retry-after", "1")))
                        continue
                    response.raise_for_status()
                    async for _line in response.aiter_lines():
                        pass
                    ids.append(response.headers["x-request-id"])
                    break
    return ids


async def _conversation(env: ChaosEnv, key: str) -> str:
    from bench.flood_clients import CREATE_ITEMS

    items = [{"type": "message", "role": "user", "content": f"setup item {i}"} for i in range(CREATE_ITEMS)]
    async with httpx.AsyncClient(base_url=env.base_url, timeout=30) as client:
        created = await client.post("/conversations", json={"items": items}, headers=_auth(key))
        created.raise_for_status()
        return str(created.json()["id"])


# --- the clients -------------------------------------------------------------------------------------------------


async def _client(role: str, config: dict[str, Any]) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.flood_clients", role, orjson.dumps(config).decode(),
        stdout=asyncio.subprocess.PIPE, start_new_session=True)


async def _result(proc: asyncio.subprocess.Process, role: str, timeout_s: float) -> dict[str, Any]:
    assert proc.stdout is not None
    raw = await asyncio.wait_for(proc.stdout.read(), timeout_s)
    await proc.wait()
    if proc.returncode != 0 or not raw.strip():
        raise RuntimeError(f"the {role} client failed (exit {proc.returncode})")
    return dict(orjson.loads(raw.strip().splitlines()[-1]))


def _end(proc: asyncio.subprocess.Process | None) -> None:
    if proc is not None and proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()


def _box_busy_s() -> float:
    """CPU seconds the whole machine has been busy (all cores, all processes)."""
    ticks = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / _TICK  # less idle and iowait


# --- a phase -----------------------------------------------------------------------------------------------------


def phase_name(flood: Flood | None) -> str:
    """``alone`` (no flood), or the flood's tier and offered rate (``max``: as fast as answered)."""
    if flood is None:
        return "alone"
    tier, rate = flood
    return f"{tier} {rate:g}/s" if rate > 0 else f"{tier} max"


@dataclass
class Run:
    env: ChaosEnv
    shape: FloodShape
    placement: Placement
    victim_key: str
    attackers: dict[str, Attacker]

    def victim_config(self, streams: int) -> dict[str, Any]:
        return {"base_url": self.env.base_url, "api_key": self.victim_key, "model": self.env.settings.model.served_name,
                "streams": streams, "concurrency": self.shape.concurrency, "max_tokens": self.shape.max_tokens,
                "cpus": list(self.placement.client_cpus), "nice": VICTIM_NICE}

    def attacker_config(self, attacker: Attacker, recent: list[str], rate: float) -> dict[str, Any]:
        return {"base_url": self.env.base_url, "api_key": attacker.key, "recent_streams": recent,
                "far_streams": attacker.far_streams, "conversation_id": attacker.conversation_id,
                "connections": self.shape.connections, "rate": rate, "kinds": list(self.shape.kinds),
                "cpus": list(self.placement.client_cpus), "nice": ATTACKER_NICE}

    async def drain(self, attacker: Attacker) -> dict[str, Any]:
        """Spends the attacker's reads and requests: every flood starts with empty buckets, whatever the phases
        before it left (a whole minute's burst, 600 reads and 600 writes, before the first). Two connections: a
        refusal for requests in flight (every tier allows more than two) would pass for an empty bucket."""
        config = {"base_url": self.env.base_url, "api_key": attacker.key,
                  "conversation_id": attacker.conversation_id, "connections": DRAIN_CONNECTIONS,
                  "cpus": list(self.placement.client_cpus), "nice": ATTACKER_NICE, "timeout_s": 300}
        drained = await _result(await _client("drain", config), "drain", 330)
        return {"wall_s": drained["wall_s"], "answers": answers(drained["kinds"], tuple(drained["kinds"]))}

    def meter(self) -> CpuMeter:
        env = self.env
        shared = {name: pid for name, pid in infra_pids(env.settings).items() if name in SHARED}
        return CpuMeter({"gateway": env.service_pid(env.gateways[0]), "worker": env.service_pid(env.workers[0]),
                         "redis": env.others[0].pid or 0, **shared}, alone=frozenset({"gateway", "worker", "redis"}))

    async def phase(self, round_: int, flood: Flood | None) -> dict[str, Any]:
        """The victim's load, alone (``flood`` None) or under the flood of the attacker of its tier at its rate."""
        timeout_s = 120 + 4 * self.shape.streams * self.shape.max_tokens / self.shape.tokens_per_s
        attacker = victim = None
        drained = None
        try:
            if flood is not None:
                # 1. Its recent streams, then its buckets spent: the flood gets what they refill while it lasts
                tier, rate = flood
                recent = await _streams(self.env, self.attackers[tier].key, ATTACKER_STREAMS)
                drained = await self.drain(self.attackers[tier])
                attacker = await _client("attacker", self.attacker_config(self.attackers[tier], recent, rate))
                assert attacker.stdout is not None
                if (await asyncio.wait_for(attacker.stdout.readline(), 60)).strip() != b"flooding":
                    raise RuntimeError("the attacker client did not start flooding")
            # 2. The victim's load, metered from its first request to its last answer
            meter, box, started = self.meter(), _box_busy_s(), time.perf_counter()
            victim = await _client("victim", self.victim_config(self.shape.streams))
            seen = await _result(victim, "victim", timeout_s)
            wall = time.perf_counter() - started
            cpu, box_busy = meter.since(), _box_busy_s() - box
            flooded = None
            if attacker is not None:
                attacker.send_signal(signal.SIGTERM)
                flooded = await _result(attacker, "attacker", 30)
        finally:
            _end(attacker)
            _end(victim)
        return {"round": round_, "phase": phase_name(flood), "tier": flood and flood[0],
                "offered_per_s": flood and flood[1], "wall_s": round(wall, 3),
                "victim": _victim_figures(seen), "attacker": _attacker_figures(flooded) if flooded else None,
                "drain": drained, "cpu_s": {name: cpu.get(name, 0.0) for name in METERED},
                "gateway_cores": round(cpu.get("gateway", 0.0) / wall, 3),
                "box_busy_cores": round(box_busy / wall, 3),
                "rest_cores": round(max(0.0, box_busy - sum(cpu.get(name, 0.0) for name in METERED) - seen["cpu_s"]
                                        - (flooded["cpu_s"] if flooded else 0.0)) / wall, 3)}


#: each phase's inter-token gaps, pooled by the summary and then left out (thousands of figures a phase)
ITL_EACH = "_itl_s_each"


def _victim_figures(seen: dict[str, Any]) -> dict[str, Any]:
    results = seen["results"]
    done = [r for r in results if r["ok"] and r["output_tokens"] > 0]
    ttft = [r["ttft"] for r in done if r["ttft"] is not None]
    itl = [gap for r in done for gap in r["itl"]]
    errors = Counter(str(r["status"] or "connection") for r in results if not r["ok"])
    return {"streams": len(results), "completed": len(done), "errors": dict(errors),
            "ttft_s": percentiles(ttft), "itl_s": percentiles(itl), "client_cpu_s": seen["cpu_s"],
            "ttft_s_each": [round(t, 4) for t in ttft], ITL_EACH: itl}


def _attacker_figures(flooded: dict[str, Any]) -> dict[str, Any]:
    kinds, wall = flooded["kinds"], flooded["wall_s"]
    sent = sum(k["sent"] for k in kinds.values())
    return {"wall_s": wall, "client_cpu_s": flooded["cpu_s"], "sent": sent, "per_s": round(sent / wall, 1),
            "reads": answers(kinds, READS), "writes": answers(kinds, WRITES), "kinds": kinds}


# --- the run -----------------------------------------------------------------------------------------------------


async def run(settings: Settings, shape: FloodShape = FloodShape(), *, port_base: int = 17900, pin: bool = True,
              say: Say = lambda _m: None) -> dict[str, Any]:
    env = ChaosEnv(settings, Ports(port_base), Knobs(tokens_per_s=shape.tokens_per_s,
                                                      max_seqs=max(16, 2 * shape.concurrency)))
    placement = Placement.split(pin)
    phases: list[dict[str, Any]] = []
    try:
        say(f"starting a stack of its own (namespace {env.namespace}, ports from {port_base})")
        await env.start(workers=1, gateways=1)
        if placement.gateway_cpus:
            pin_threads({"gateway": env.service_pid(env.gateways[0])}, set(placement.gateway_cpus))
        bench = Run(env, shape, placement, env.api_key,
                    {tier: await Attacker.open(env, tier) for tier in shape.tiers})
        say("warming up (the victim's load, not measured)")
        await _result(await _client("victim", bench.victim_config(2 * shape.concurrency)), "victim", 120)
        for r in range(shape.rounds):
            for flood in (None, *shape.floods()):
                phases.append(await bench.phase(r, flood))
                say(_line(phases[-1]))
    finally:
        await env.stop()
    return summarize(shape, placement, phases)


def _line(phase: dict[str, Any]) -> str:
    v = phase["victim"]
    text = (f"round {phase['round'] + 1} {phase['phase']}: {v['completed']}/{v['streams']} streams, TTFT p50/p99 "
            f"{_ms(v['ttft_s']['p50'])}/{_ms(v['ttft_s']['p99'])} ms, gateway {phase['cpu_s']['gateway']:.1f} CPU s")
    if (a := phase["attacker"]) is not None:
        text += f"; attacker {a['per_s']}/s, reads {a['reads']}, writes {a['writes']}"
    return text


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def _pooled(mine: list[dict[str, Any]]) -> dict[str, Any]:
    """One kind of phase over the rounds: the victim's figures of all its streams, CPU and rates summed."""
    wall = sum(p["wall_s"] for p in mine)
    cpu = {name: round(sum(p["cpu_s"][name] for p in mine), 3) for name in METERED}
    out: dict[str, Any] = {
        "phases": len(mine), "completed": sum(p["victim"]["completed"] for p in mine),
        "streams": sum(p["victim"]["streams"] for p in mine),
        "ttft_s": percentiles([t for p in mine for t in p["victim"]["ttft_s_each"]]),
        "itl_s": percentiles([gap for p in mine for gap in p["victim"].pop(ITL_EACH, [])]),
        "wall_s": round(wall, 3), "cpu_s": cpu, "gateway_cores": round(cpu["gateway"] / wall, 3),
        "box_busy_cores": round(sum(p["box_busy_cores"] * p["wall_s"] for p in mine) / wall, 3),
        "rest_cores": round(sum(p["rest_cores"] * p["wall_s"] for p in mine) / wall, 3),
    }
    attacks = [p["attacker"] for p in mine if p["attacker"]]
    if attacks:
        flooded = sum(a["wall_s"] for a in attacks)
        out["attacker"] = {
            "offered_per_s": mine[0]["offered_per_s"] or None,
            "per_s": round(sum(a["sent"] for a in attacks) / flooded, 1),
            "reads": dict(sum((Counter(a["reads"]) for a in attacks), Counter())),
            "writes": dict(sum((Counter(a["writes"]) for a in attacks), Counter())),
            "client_cpu_s": round(sum(a["client_cpu_s"] for a in attacks), 3),
            "by_kind": {kind: {"per_s": round(sum(a["kinds"][kind]["sent"] for a in attacks) / flooded, 1),
                               "statuses": dict(sum((Counter(a["kinds"][kind]["statuses"]) for a in attacks),
                                                    Counter()))}
                        for kind in KINDS},
        }
    return out


def summarize(shape: FloodShape, placement: Placement, phases: list[dict[str, Any]]) -> dict[str, Any]:
    names = [phase_name(flood) for flood in (None, *shape.floods())]
    pooled = {name: _pooled([p for p in phases if p["phase"] == name]) for name in names}
    by_round = {name: [p["victim"]["ttft_s_each"] for p in phases if p["phase"] == name] for name in names}
    return {"shape": asdict(shape), "engine": "synthetic", "placement": placement.as_json(),
            "bound": {"share": BOUND_SHARE, "floor_s": BOUND_FLOOR_S, "statistic": "median over the rounds of "
                      "each round's flood TTFT p99 minus its alone TTFT p99",
                      "by_flood": {name: bound(by_round["alone"], by_round[name]) for name in names[1:]}},
            "pooled": pooled, "phases": phases}
