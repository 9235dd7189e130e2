"""Billing: usage events → the ledger (one row per request id) → hourly aggregates.

Guarantee: Faust ``exactly_once``, which is also what makes its consumer read ``read_committed`` — usage from an
aborted worker transaction is never billed. The sinks do not rely on it: the ledger insert is first-wins by
request id, the views are upserts of the winner, the aggregates are recomputed from the ledger. A processor
killed at any point and restarted converges to the same ledger.

Prices: the price book is reloaded every ``processors.price_reload_s``; a failed reload (Cassandra down) is logged
and tried again at the next tick. The book knows how far it can vouch for the price table (``PriceLead.reach``
past its load), and a usage event beyond that is priced only after a fresh load (waiting out an outage), never
with a version that may since have been superseded. What even a fresh book cannot vouch for is dead-lettered.

Spend: once the ledger holds a request's row, its cost is charged to the org-month's spend in Redis, replacing
the request's budget hold (``runtime/spend.py``; once per request id). A charge that takes the org's billed spend
past its alert fraction, or to its budget, raises a ``BudgetAlert`` (id deterministic per org, month, kind and
budget: a redelivery rewrites the same record of the compacted alerts topic); Redis notes that it was raised only
after the send, so a crash in between raises it again rather than never.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial
from typing import Any

import faust

from billing.ledger import Ledger, LedgerRow
from billing.prices import LivePrices, PriceLead, PriceStore, UnknownPrice
from runtime.cassandra_client import connect
from runtime.metrics import BILLING_HOURS_RECOMPUTED, BILLING_RECORDED, BUDGET_ALERTS
from runtime.redis_client import make_redis
from runtime.retry import TRANSIENT, retry_transient
from runtime.settings import Settings
from runtime.spend import Charged, SpendBook, month_of, usd
from schemas.codec import codec_for
from schemas.events import BudgetAlert, UsageEvent, utcnow
from schemas.topics import TOPICS
from stream_processors.app import DeadLetters, build_app, raw_topic

log = logging.getLogger(__name__)


@dataclass
class Biller:
    ledger: Ledger
    prices: LivePrices
    spend: SpendBook

    async def bill(self, usage: UsageEvent) -> tuple[LedgerRow, bool, Charged]:
        """UnknownPrice (PriceBookStale included) when the usage cannot be priced now."""
        row = LedgerRow.from_usage(usage, await self.prices.book_for(usage.requested_at))
        winner, created = await retry_transient(lambda: self.ledger.record(row), what="ledger write")
        charged = await retry_transient(
            lambda: self.spend.charge(winner.request_id, winner.org_id, winner.requested_at, winner.cost),
            what="spend charge")
        return winner, created, charged


def budget_alerts(row: LedgerRow, charged: Charged) -> list[BudgetAlert]:
    month = month_of(row.requested_at)
    return [BudgetAlert(alert_id=f"budget:{row.org_id}:{month}:{kind}:{charged.budget_nanos}", org_id=row.org_id,
                        month=month, kind=kind, billed_usd=str(usd(charged.billed_nanos)),
                        budget_usd=str(usd(charged.budget_nanos or 0)), alert_fraction=charged.alert_fraction,
                        request_id=row.request_id, raised_at=utcnow())
            for kind in charged.due()]


def build(settings: Settings) -> faust.App:
    app = build_app(settings, "billing", guarantee="exactly_once")
    _cluster, session = connect(settings.cassandra, keyspace=settings.cassandra.keyspace)
    store = PriceStore(session, settings.cassandra.keyspace, PriceLead(settings.processors.price_reload_s))
    biller = Biller(Ledger(session, settings.cassandra.keyspace), LivePrices(store, store.load_sync()),
                    SpendBook(make_redis(settings.redis), settings.redis))
    dead = DeadLetters(app, settings, "billing")
    codec = codec_for(UsageEvent)
    alert_codec = codec_for(BudgetAlert)
    alerts = raw_topic(app, settings, TOPICS.budget_alerts)

    async def raise_alerts(row: LedgerRow, charged: Charged) -> None:
        if charged.budget_nanos is None:
            return
        for alert in budget_alerts(row, charged):
            # Marked raised only once the broker has it (Faust's sends are not part of its transactions).
            await (await alerts.send(key=alert.alert_id.encode(), value=alert_codec.encode(alert)))
            await retry_transient(partial(biller.spend.alerted, alert.org_id, alert.month, alert.kind,
                                          charged.budget_nanos), what="budget alert mark")
            BUDGET_ALERTS.labels(kind=alert.kind).inc()
            log.warning("budget alert", extra={"org_id": alert.org_id, "kind": alert.kind, "month": alert.month,
                                               "billed_usd": alert.billed_usd, "budget_usd": alert.budget_usd})

    @app.agent(raw_topic(app, settings, TOPICS.usage))
    async def bill(stream: Any) -> None:
        async for event in stream.events():
            usage = await dead.decode(codec, event)
            if usage is None:
                continue
            try:
                row, created, charged = await biller.bill(usage)
            except UnknownPrice as exc:  # not billable yet: kept for an operator (add the price, then repair)
                await dead.send(event, str(exc))
                continue
            await raise_alerts(row, charged)
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
