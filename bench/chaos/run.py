"""One chaos scenario, start to end: a fresh stack, the load, the fault, the audit, the stack taken down."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from bench.chaos.audit import Table, audit
from bench.chaos.client import Load, Stream
from bench.chaos.environment import ChaosEnv, Knobs, Ports
from bench.chaos.scenarios import Say, Scenario
from runtime.settings import Settings
from schemas.events import utcnow


@dataclass(frozen=True)
class LoadShape:
    requests: int = 32
    concurrency: int = 8
    max_tokens: int = 60
    temperature: float = 0.0
    seed: int | None = None
    #: every other stream greedy, the others at ``temperature`` with ``seed``; every third a structured output
    mixed: bool = False


async def run_scenario(settings: Settings, scenario: Scenario, shape: LoadShape, *, engine: str = "synthetic",
                       port_base: int = 17500, say: Say = lambda _m: None, timeout_s: float = 600.0
                       ) -> tuple[Table, list[Stream], dict[str, Any]]:
    env = ChaosEnv(settings, Ports(port_base), scenario.knobs(Knobs(engine=engine)))
    try:
        say(f"starting a stack of its own (namespace {env.namespace}, {scenario.workers} workers, "
            f"{scenario.gateways} gateways, {engine} engine)")
        await env.start(workers=scenario.workers, gateways=scenario.gateways, writer=scenario.conversations)

        def new_load() -> Load:
            return Load(env.base_urls, env.api_key, settings.model.served_name, requests=shape.requests,
                        concurrency=shape.concurrency, max_tokens=shape.max_tokens,
                        label=f"{scenario.name}-{env.run_id}", temperature=shape.temperature, seed=shape.seed,
                        mixed=shape.mixed, conversations=scenario.conversations)

        reference = None
        if engine != "synthetic":
            # A real model's text cannot be computed here: the same prompts once without a fault are the reference.
            say("reference pass: the same streams without a fault")
            reference = [s.text for s in await new_load().run()]
        await scenario.before_load(env, say)
        started_at = utcnow()
        load = new_load()
        if scenario.conversations:
            await load.open_conversations()
        say(f"load: {shape.requests} streams of {shape.max_tokens} tokens, {shape.concurrency} at a time")
        running = asyncio.create_task(load.run())
        await scenario.inject(env, load, say)
        streams = await asyncio.wait_for(running, timeout_s)
        say(f"load done at {load.now():.1f} s; auditing streams, token log and ledger")
        table = await audit(scenario.name, settings, env.kafka(), env.org_id, streams, started_at,  # type: ignore[arg-type]
                            expectation=scenario.expectation, fault_at=load.fault_at,
                            synthetic=engine == "synthetic", reference=reference, redis=env.redis_settings(),
                            redis_wiped=scenario.name == "restart-redis",
                            conversations=(env.base_url, env.api_key) if scenario.conversations else None)
        context = {"namespace": env.namespace, "engine": engine, "knobs": env.knobs.__dict__,
                   "workers": scenario.workers, "gateways": scenario.gateways, "shape": shape.__dict__,
                   "summary": scenario.summary}
        return table, streams, context
    finally:
        await env.stop()
