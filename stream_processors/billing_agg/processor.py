"""Billing: usage events → the ledger (one row per request id) → hourly aggregates.

Guarantee: Faust ``exactly_once``, which is also what makes its consumer read ``read_committed`` — usage from an
aborted worker transaction is never billed. The sinks do not rely on it: the ledger insert is first-wins by
request id, the views are upserts of the winner, the aggregates are recomputed from the ledger. A processor
killed at any point and restarted converges to the same ledger.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import faust

from billing.ledger import Ledger, LedgerRow
from billing.prices import PriceBook, PriceStore, UnknownPrice
from runtime.cassandra_client import connect
from runtime.metrics import BILLING_HOURS_RECOMPUTED, BILLING_RECORDED
from runtime.retry import retry_transient
from runtime.settings import Settings
from schemas.codec import codec_for
from schemas.events import UsageEvent
from schemas.topics import TOPICS
from stream_processors.app import DeadLetters, build_app, raw_topic

log = logging.getLogger(__name__)


@dataclass
class Biller:
    ledger: Ledger
    prices: PriceBook

    async def bill(self, usage: UsageEvent) -> tuple[LedgerRow, bool]:
        row = LedgerRow.from_usage(usage, self.prices)
        return await retry_transient(lambda: self.ledger.record(row), what="ledger write")


def build(settings: Settings) -> faust.App:
    app = build_app(settings, "billing", guarantee="exactly_once")
    _cluster, session = connect(settings.cassandra, keyspace=settings.cassandra.keyspace)
    store = PriceStore(session, settings.cassandra.keyspace)
    biller = Biller(Ledger(session, settings.cassandra.keyspace), store.load_sync())
    dead = DeadLetters(app, settings, "billing")
    codec = codec_for(UsageEvent)

    @app.agent(raw_topic(app, settings, TOPICS.usage))
    async def bill(stream: Any) -> None:
        async for event in stream.events():
            usage = await dead.decode(codec, event)
            if usage is None:
                continue
            try:
                row, created = await biller.bill(usage)
            except UnknownPrice as exc:  # not billable yet: kept for an operator (add the price, then repair)
                await dead.send(event, str(exc))
                continue
            BILLING_RECORDED.labels(created=str(created).lower()).inc()
            log.info("usage billed", extra={"request_id": row.request_id, "new_row": created, "cost": str(row.cost)})

    @app.timer(interval=settings.processors.billing_flush_interval_s)
    async def flush_aggregates() -> None:
        BILLING_HOURS_RECOMPUTED.inc(await retry_transient(biller.ledger.flush_dirty, what="aggregates"))

    @app.timer(interval=settings.processors.price_reload_s)
    async def reload_prices() -> None:
        biller.prices = await store.load()

    return app
