"""``kns billing reconcile --repair`` on a real usage topic and ledger: it says what it repaired and what it
leaves for an operator, and a billed row's cost survives a change of the price table."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import uuid
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest

from billing.ledger import Ledger, LedgerRow
from billing.prices import Price, PriceBook
from runtime.cassandra_client import connect_async, execute
from runtime.kafka_clients import make_producer
from runtime.settings import REPO_ROOT, Settings
from schemas.codec import codec_for
from schemas.events import UsageEvent
from schemas.topics import TOPICS

pytestmark = pytest.mark.integration
HOUR = datetime(2026, 3, 5, 9, 0, tzinfo=UTC)


def kns(service_env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ops.cli", "billing", *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120, env={**service_env, "COLUMNS": "250"})


@pytest.mark.timeout(240)  # CLI runs, up to 120 s each
async def test_repair_reports_what_it_changed_and_never_reprices(stack: Settings,
                                                                 service_env: dict[str, str]) -> None:
    model, org = f"m-{uuid.uuid4().hex[:10]}", f"org-{uuid.uuid4().hex[:8]}"
    v1 = Price(model, datetime(2026, 1, 1, tzinfo=UTC), "v1", Decimal("1"), Decimal("0.5"), Decimal("2"))
    events = [UsageEvent(request_id=f"req-{uuid.uuid4().hex}", org_id=org, key_id="k", tier="pro", model=model,
                         prompt_tokens=10, completion_tokens=4, cached_tokens=0, finish_reason="stop", attempt=1,
                         worker_id="w", requested_at=HOUR + timedelta(minutes=i), started_at=HOUR,
                         finished_at=HOUR + timedelta(minutes=i)) for i in range(3)]
    kept, corrupted, lost = events
    producer = make_producer(stack.kafka, role="test-reconcile")
    await producer.start()
    try:
        for event in events:
            await producer.send_and_wait(stack.kafka.topic(TOPICS.usage.name), codec_for(UsageEvent).encode(event),
                                         key=event.request_id.encode())
    finally:
        await producer.stop()
    cluster, session = await connect_async(stack.cassandra)
    ks = stack.cassandra.keyspace
    try:
        ledger = await Ledger.open(session, ks)
        billed = {u.request_id: LedgerRow.from_usage(u, PriceBook([v1])) for u in (kept, corrupted)}
        for row in billed.values():
            await ledger.record(row)
        await execute(session, f"UPDATE {ks}.ledger_by_request SET completion_tokens = 4242 WHERE request_id = %s",
                      (corrupted.request_id,))
        # The price table as it was, then a version backdated under the billed rows (straight into the table: what
        # `set-price` used to accept, and a stand-in for any edit made before prices became append-only).
        insert = (f"INSERT INTO {ks}.prices (model, valid_from, version, input_per_mtok, cached_input_per_mtok, "
                  "output_per_mtok) VALUES (%s, %s, %s, %s, %s, %s)")
        await execute(session, insert, (model, v1.valid_from, "v1", Decimal("1"), Decimal("0.5"), Decimal("2")))
        await execute(session, insert, (model, HOUR, "v1b", Decimal("10"), Decimal("5"), Decimal("20")))

        window = ["--start", HOUR.isoformat(), "--end", (HOUR + timedelta(hours=1)).isoformat(), "--org", org]
        repair = await asyncio.to_thread(kns, service_env, "reconcile", *window, "--repair")
        out = repair.stdout
        assert repair.returncode == 1, out + repair.stderr  # the repriced rows stay: reported, not rewritten
        assert await ledger.get(kept.request_id) == billed[kept.request_id]
        assert await ledger.get(corrupted.request_id) == billed[corrupted.request_id]
        inserted = await ledger.get(lost.request_id)
        assert inserted is not None and inserted.price_version == "v1b"
        assert "repaired 2 rows" in out and "1 inserted" in out and "1 corrected" in out, out
        assert "2 not repairable" in out and "repriced" in out and "billed costs are final" in out, out
    finally:
        await asyncio.to_thread(cluster.shutdown)
