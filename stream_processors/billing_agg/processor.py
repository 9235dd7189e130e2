"""Billing: usage events → the ledger (one row per request id) → hourly aggregates.

Guarantee: Faust ``exactly_once``, which is also what makes its consumer read ``read_committed`` — usage from an
aborted worker transaction is never billed. The sinks do not rely on it: the ledger insert is first-wins by
request id, the views are upserts of the winner, the aggregates are recomputed from the ledger. A processor
killed at any point and restarted converges to the same ledger.

Prices: the price book is reloaded every ``processors.price_reload_s``; a failed reload (Cassandra down) is logged
and tried again at the next tick. The book knows how far it can vouch for the price table (``PriceLead.reach``
past its load), and a usage event beyond that is priced only after a fresh load (waiting out an outage), never
with a version that may since have been superseded. What even a fresh book cannot vouch for is dead-lettered.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import faust

from billing.ledger import Ledger, LedgerRow
from billing.prices import LivePrices, PriceLead, PriceStore, UnknownPrice
from runtime.cassandra_client import connect
from runtime.metrics import BILLING_HOURS_RECOMPUTED, BILLING_RECORDED
from runtime.retry import TRANSIENT, retry_transient
from runtime.settings import Settings
from schemas.codec import codec_for
from schemas.events import UsageEvent
from schemas.topics import TOPICS
from stream_processors.app import DeadLetters, build_app, raw_topic

log = logging.getLogger(__name__)


@dataclass
class Biller:
    ledger: Ledger
    prices: LivePrices

    async def bill(self, usage: UsageEvent) -> tuple[LedgerRow, bool]:
        """UnknownPrice (PriceBookStale included) when the usage cannot be priced now."""
        row = LedgerRow.from_usage(usage, await self.prices.book_for(usage.requested_at))
        return await retry_transient(lambda: self.ledger.record(row), what="ledger write")


def build(settings: Settings) -> faust.App:
    app = build_app(settings, "billing", guarantee="exactly_once")
    _cluster, session = connect(settings.cassandra, keyspace=settings.cassandra.keyspace)
    store = PriceStore(session, settings.cassandra.keyspace, PriceLead(settings.processors.price_reload_s))
    biller = Biller(Ledger(session, settings.cassandra.keyspace), LivePrices(store, store.load_sync()))
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
        # NOTE: an exception here would end Faust's timer for good; a transient one is logged and retried next tick
        # (the book stops vouching for new times meanwhile, and bill() reloads on its own).
        try:
            book = await biller.prices.reload()
        except TRANSIENT as exc:
            log.warning("price reload failed", extra={"reason": repr(exc),
                                                      "complete_until": str(biller.prices.book.complete_until)})
            return
        log.debug("prices reloaded", extra={"complete_until": str(book.complete_until)})

    return app
