"""Prefix-cache affinity: multi-turn conversations on two workers, with the turns of a conversation keyed by it on
the work queue (one partition, one worker, whose prefix cache holds the history) and without (keyed by request id,
spread over both workers).

Both setups run on the same two workers, one after the other; only the gateway is restarted with
``gateway.conversation_affinity`` off. Each conversation starts with a text of its own, so no cache carries over
from one setup to the other. Turns run one at a time (nothing else competes for the engines): per turn, the
engine's own count of prompt tokens served from its cache (``usage.input_tokens_details.cached_tokens``) and the
time to the first ``response.output_text.delta``, measured by the client.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

import httpx
import orjson

from bench.servers import Proc, pipeline
from runtime.settings import Settings

#: ~100 tokens of new input per turn: the history grows to most of a 2,048-token context by turn 10
TURN_TEXT = ("Here is one more paragraph for you to keep in mind as we talk. It describes a small harbour town, its "
             "boats, its market on Saturdays, the lighthouse at the end of the pier and the people who fish there "
             "before dawn. Please answer in one short sentence.")


async def run(settings: Settings, *, conversations: int, turns: int, output_tokens: int,
              say: Callable[[str], None]) -> dict[str, Any]:
    namespace = f"affinity{uuid.uuid4().hex[:6]}"
    gateway_port, worker_port, store_port = 8600, 8610, 8620
    results: dict[str, Any] = {"conversations": conversations, "turns": turns, "output_tokens": output_tokens,
                               "workers": 2, "namespace": namespace, "setups": {}}
    secret, procs = await pipeline(settings, namespace=namespace, gateway_port=gateway_port,
                                   worker_port=worker_port, prefix="affinity", workers=2)
    *workers, gateway = procs
    store = Proc("affinity-store", [sys.executable, "-m", "ops.cli", "processor", "store"],
                 {**gateway.env, "KNS_PROCESSORS__STORE_PORT": str(store_port)},
                 f"http://127.0.0.1:{store_port}/health")
    started: list[Proc] = []
    try:
        for proc in [*workers, store]:
            proc.start()
            started.append(proc)
        for proc in [*workers, store]:
            await proc.wait(900)
        for affinity in (True, False):
            label = "affinity" if affinity else "none"
            gateway.env = {**gateway.env, "KNS_GATEWAY__CONVERSATION_AFFINITY": str(affinity).lower()}
            gateway.start()
            started.append(gateway)
            await gateway.wait(300)
            say(f"{label}: {conversations} conversations x {turns} turns")
            rows = await _setup(f"http://127.0.0.1:{gateway_port}/v1", secret, conversations, turns, output_tokens)
            results["setups"][label] = _summary(rows)
            gateway.stop()
    finally:
        for proc in reversed(started):
            proc.stop()
    both = results["setups"]
    results["ttft_p50_ratio_none_over_affinity"] = _ratio(both["none"]["ttft_s_p50_turns_2_on"],
                                                          both["affinity"]["ttft_s_p50_turns_2_on"])
    results["cores"] = len(os.sched_getaffinity(0))
    return results


async def _setup(base_url: str, secret: str, conversations: int, turns: int, output_tokens: int
                 ) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    headers = {"authorization": f"Bearer {secret}"}
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=300) as http:
        for c in range(conversations):
            created = await http.post("/conversations", json={})
            created.raise_for_status()
            conversation = created.json()["id"]
            opening = f"Conversation {uuid.uuid4().hex}. "  # its own prefix: no cache from another conversation
            for turn in range(turns):
                text = (opening if turn == 0 else "") + TURN_TEXT
                rows.append({"conversation": c, "turn": turn + 1,
                             **await _turn(http, conversation, text, output_tokens)})
    return rows


async def _turn(http: httpx.AsyncClient, conversation: str, text: str, output_tokens: int) -> dict[str, Any]:
    body = {"model": "SmolLM2-135M-Instruct", "conversation": conversation, "input": text, "stream": True,
            "max_output_tokens": output_tokens, "temperature": 0, "truncation": "auto"}
    sent, first, final = time.perf_counter(), None, None
    async with http.stream("POST", "/responses", json=body) as answer:
        answer.raise_for_status()
        async for line in answer.aiter_lines():
            if not line.startswith("data: "):
                continue
            event = orjson.loads(line[6:])
            if event["type"] == "response.output_text.delta" and first is None:
                first = time.perf_counter()
            if event["type"] in ("response.completed", "response.incomplete", "response.failed"):
                final = event["response"]
    if final is None or final["usage"] is None:
        raise RuntimeError(f"a turn ended without its usage: {final}")
    usage = final["usage"]
    return {"status": final["status"], "ttft_s": round(first - sent, 4) if first else None,
            "input_tokens": usage["input_tokens"], "cached_tokens": usage["input_tokens_details"]["cached_tokens"],
            "truncated_items": final.get("truncated_items", 0)}


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    later = [r for r in rows if r["turn"] > 1]
    ttfts = [r["ttft_s"] for r in later if r["ttft_s"] is not None]
    by_turn = {}
    for turn in sorted({r["turn"] for r in rows}):
        of_turn = [r for r in rows if r["turn"] == turn]
        by_turn[turn] = {"cached_tokens_p50": statistics.median(r["cached_tokens"] for r in of_turn),
                         "input_tokens_p50": statistics.median(r["input_tokens"] for r in of_turn),
                         "ttft_s_p50": statistics.median(r["ttft_s"] for r in of_turn if r["ttft_s"] is not None)}
    prompt = sum(r["input_tokens"] for r in later)
    return {"turns": rows, "by_turn": by_turn,
            "cached_share_turns_2_on": round(sum(r["cached_tokens"] for r in later) / prompt, 3) if prompt else None,
            "ttft_s_p50_turns_2_on": round(statistics.median(ttfts), 4) if ttfts else None,
            "errors": sum(r["status"] == "failed" for r in rows)}


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a and b else None
