"""``kns bench flood`` at a tiny size, so that it cannot rot: a stack of its own (``bench/chaos``: synthetic engine,
its own namespace and Redis), one round of the victim alone and under the attacker's flood. The benchmark measures
what the flood does to the victim's TTFT (docs/PERFORMANCE.md); this only holds it to finishing, to every stream of
the victim completing, and to the attacker's limits biting (429s for its reads and for its writes)."""

from __future__ import annotations

import pytest

from bench.flood_clients import KINDS
from bench.tenant_flood import FloodShape, run
from runtime.settings import Settings
from tests.conftest import PORT_BASE

pytestmark = pytest.mark.e2e

TINY = FloodShape(rounds=1, streams=12, concurrency=4, max_tokens=8, connections=8, rates=(200.0,),
                  tiers=("plus",))


@pytest.mark.timeout(480)
async def test_a_flooding_tenant_is_refused_while_the_other_tenants_streams_all_complete(stack: Settings) -> None:
    result = await run(stack, TINY, port_base=PORT_BASE + 700)

    assert [(p["round"], p["phase"]) for p in result["phases"]] == [(0, "alone"), (0, "plus 200/s")]
    for phase in result["phases"]:
        victim = phase["victim"]
        assert victim["completed"] == victim["streams"] == TINY.streams, victim["errors"]
        assert victim["ttft_s"]["p99"] < 10.0  # a sanity bound only: the figure is the benchmark's
        assert phase["cpu_s"]["gateway"] > 0
    attacker = result["pooled"]["plus 200/s"]["attacker"]
    assert attacker["reads"].get("429", 0) > 0 and attacker["writes"].get("429", 0) > 0
    assert all(sum(attacker["by_kind"][kind]["statuses"].values()) > 0 for kind in KINDS)
    assert set(result["bound"]["by_flood"]["plus 200/s"]) >= {"moved_s", "allowed_s", "holds"}
