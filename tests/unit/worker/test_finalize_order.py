"""The order of a finalizing transaction's requests to the broker. Kafka checks a transaction's first record on
each partition with the transaction coordinator; an AddOffsetsToTxn in flight at that moment makes the check fail
(CONCURRENT_TRANSACTIONS, handed to aiokafka as NOT_ENOUGH_REPLICAS) and the records wait out a 100 ms retry. On the
real broker: ``tests/integration/test_finalizer.py::test_no_final_waits_out_a_produce_retry_behind_its_own_offsets``."""

from __future__ import annotations

import asyncio

from inference_workers.emitter import Finalizer
from inference_workers.offsets import CommittedState, OffsetTracker
from tests.fakes.kafka import FakeClaims
from tests.unit.worker.test_text_and_billing_faults import P0, FakeTxnProducer, OneProducer, _finished


class AcksOnTheNextTurn(FakeTxnProducer):
    """Each record's ack comes a loop turn after its send, as the broker's does; notes which records were still
    unacknowledged when the offsets joined the transaction."""

    def __init__(self) -> None:
        super().__init__([])
        self.refuse_final_once = False
        self.deliveries: list[asyncio.Future[None]] = []
        self.unacked_at_offsets: list[int] = []

    def delivery(self) -> asyncio.Future[None]:
        ack: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_soon(ack.set_result, None)
        self.deliveries.append(ack)
        return ack

    async def send_offsets_to_transaction(self, offsets: object, group_id: str) -> None:
        self.unacked_at_offsets.append(sum(not d.done() for d in self.deliveries))


async def test_a_transactions_records_are_acknowledged_before_its_offsets_join_it() -> None:
    offsets = OffsetTracker()
    offsets.restore(P0, CommittedState(0, 0, frozenset()))
    offsets.taken(P0, 0)
    producer = AcksOnTheNextTurn()
    finalizer = Finalizer(OneProducer(producer), token_topic="tokens",  # type: ignore[arg-type]
                          usage_topic="usage", group_id="g", offsets=offsets, claims=FakeClaims(), batch_max=8,
                          give_up_s=5)
    loop = asyncio.create_task(finalizer.run())
    await finalizer.finish(_finished(5, billed=True))
    await finalizer.stop()
    await loop
    assert [topic for topic, _ in producer.log] == ["tokens", "usage"]
    assert producer.unacked_at_offsets == [0], (
        f"{producer.unacked_at_offsets[0]} record(s) still in flight when the offsets joined the transaction")
