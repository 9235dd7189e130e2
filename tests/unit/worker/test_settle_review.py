"""The worker's settlement of rate-limit reservations, from an adversarial review of the change that added it
(emitter.py ``Finalizer._settle``). Each test fails on the reviewed code, for the reason its docstring gives."""

from __future__ import annotations

import asyncio
import contextlib

from redis.exceptions import ConnectionError as RedisConnectionError

from inference_workers.emitter import Finalizer
from inference_workers.offsets import CommittedState, OffsetTracker
from tests.fakes.kafka import FakeClaims, OneProducer
from tests.unit.worker.test_text_and_billing_faults import P0, FakeTxnProducer, _finished


class FlakySettlements:
    """Redis refusing the first settlement (a restart, a 2 s socket timeout, a failover), answering afterwards."""

    def __init__(self, failures: int = 1) -> None:
        self.failures = failures
        self.settled: list[tuple[str, int, bool]] = []
        self.landed = asyncio.Event()

    async def settle_many(self, used: list[tuple[str, int, bool]]) -> int:
        if self.failures:
            self.failures -= 1
            raise RedisConnectionError("Connection reset by peer")
        self.settled += used
        self.landed.set()
        return len(used)


async def test_a_settlement_that_failed_once_is_retried_until_it_lands() -> None:
    """Promise 2 (after all requests end, the settled counters equal the ledger). emitter.py:310-315: when
    ``settle_many`` raises, the worker logs and returns; the settlement is never tried again. The request's
    UsageEvent is committed (the ledger charges 4 + 5) and its offset with it, so no redelivery or takeover will
    ever settle it either (a redelivered record is skipped as ``finished_before``, intake.py:216-217): the
    reservation expires after ``reservation_ttl_s`` without its INCRBY, and the settled counters stay short of
    the ledger forever. A worker SIGKILLed between the commit (emitter.py:260) and ``_settle`` (emitter.py:299,
    after a Redis round trip for ``mark_done``) loses it the same way; that window cannot be shown without
    processes. Fix: settle from the committed usage topic (a read_committed consumer, e.g. next to billing_agg:
    exact by construction, idempotent since the reservation is deleted once), or at least keep failed
    settlements and retry them with backoff (and on a takeover that finds the request finished)."""
    settlements = FlakySettlements()
    offsets = OffsetTracker()
    offsets.restore(P0, CommittedState(0, 0, frozenset()))
    offsets.taken(P0, 0)
    producer = FakeTxnProducer([])
    producer.refuse_final_once = False
    finalizer = Finalizer(OneProducer(producer), token_topic="tokens",  # type: ignore[arg-type]
                          usage_topic="usage", group_id="g", offsets=offsets, claims=FakeClaims(), batch_max=8,
                          give_up_s=5, settlements=settlements)
    loop = asyncio.create_task(finalizer.run())
    item = _finished(5, billed=True)
    await finalizer.finish(item)
    assert [topic for topic, _ in producer.log] == ["tokens", "usage"]  # committed: the ledger charges 9
    with contextlib.suppress(TimeoutError):  # a retry with backoff has 3 s to land
        await asyncio.wait_for(settlements.landed.wait(), 3.0)
    await finalizer.stop()
    await loop
    assert settlements.settled == [(item.final.request_id, 9, True)], "the committed usage was never settled"
