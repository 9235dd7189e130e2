"""The order of a finalizing transaction's requests to the broker, and what a refused record leaves.

Kafka checks a transaction's first record on each partition with the transaction coordinator; an AddOffsetsToTxn in
flight at that moment makes the check fail (CONCURRENT_TRANSACTIONS, handed to aiokafka as NOT_ENOUGH_REPLICAS) and
the records wait out a 100 ms retry (on the real broker:
``tests/integration/test_finalizer.py::test_no_final_waits_out_a_produce_retry_behind_its_own_offsets``). And a
record the broker refuses fails only its own delivery: aiokafka would commit the transaction without it. The last
three tests are from the adversarial review of the change that awaits the deliveries; each failed on it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from aiokafka import TopicPartition
from aiokafka.errors import KafkaConnectionError, MessageSizeTooLargeError, ProducerFenced
from aiokafka.producer.transaction_manager import TransactionManager

from inference_workers.emitter import Finalizer, Finished, PartitionLost
from inference_workers.offsets import CommittedState, OffsetTracker, Taken, decode_state
from schemas.codec import codec_for
from schemas.events import ErrorCode, TokenEvent, UsageEvent
from tests.fakes.kafka import FakeClaims, OneProducer, TxnProducerStub
from tests.unit.worker.test_text_and_billing_faults import P0, FakeTxnProducer, _finished


class AcksLater(FakeTxnProducer):
    """Each record's ack comes 10 ms after its send, as the broker's does; notes which records were still
    unacknowledged when the offsets joined the transaction."""

    def __init__(self) -> None:
        super().__init__([])
        self.refuse_final_once = False
        self.deliveries: list[asyncio.Future[None]] = []
        self.unacked_at_offsets: list[int] = []

    def delivery(self) -> asyncio.Future[None]:
        ack: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_later(0.01, ack.set_result, None)
        self.deliveries.append(ack)
        return ack

    async def send_offsets_to_transaction(self, offsets: object, group_id: str) -> None:
        self.unacked_at_offsets.append(sum(not d.done() for d in self.deliveries))


async def test_a_transactions_records_are_acknowledged_before_its_offsets_join_it() -> None:
    offsets = OffsetTracker()
    offsets.restore(P0, CommittedState(0, 0, frozenset()))
    offsets.taken(P0, 0)
    producer = AcksLater()
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


class BrokerRefuses(TxnProducerStub):
    """As aiokafka's producer: ``send`` returns the record's delivery; a record the broker refuses (a topic's
    ``max.message.bytes`` below the producer's limit) fails its delivery only, and the transaction commits what
    landed unless the block ends in an exception (then it aborts)."""

    def __init__(self, refused_request: str) -> None:
        super().__init__()
        self.refused_request = refused_request
        self.log: list[tuple[str, TokenEvent | UsageEvent]] = []
        self.offsets_sent: list[dict[object, object]] = []

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[None]:
        self._pending: list[tuple[str, TokenEvent | UsageEvent]] = []
        self._offsets: list[dict[object, object]] = []
        yield
        await asyncio.sleep(0)
        self.log.extend(self._pending)
        self.offsets_sent.extend(self._offsets)

    async def send(self, topic: str, value: bytes, key: bytes, partition: int | None = None,
                   headers: object = None) -> asyncio.Future[None]:
        loop = asyncio.get_running_loop()
        delivery: asyncio.Future[None] = loop.create_future()
        event = (codec_for(TokenEvent) if topic == "tokens" else codec_for(UsageEvent)).decode(value)
        if topic == "tokens" and event.request_id == self.refused_request and event.token_ids:
            loop.call_soon(delivery.set_exception, MessageSizeTooLargeError("the record is too large for the topic"))
        else:
            self._pending.append((topic, event))
            loop.call_soon(delivery.set_result, None)
        return delivery

    async def send_offsets_to_transaction(self, offsets: object, group_id: str) -> None:
        assert isinstance(offsets, dict)
        self._offsets.append(offsets)


async def _one_refused(refused_second: bool) -> tuple[BrokerRefuses, Finished, Finished]:
    """Two requests finalized in one batch, one of whose finals the broker refuses."""
    offsets = OffsetTracker()
    offsets.restore(P0, CommittedState(0, 0, frozenset()))
    offsets.taken(P0, 0)
    offsets.taken(P0, 1)
    first, second = _finished(3, billed=True), _finished(4, billed=True)
    first.offset, second.offset = 0, 1
    producer = BrokerRefuses((second if refused_second else first).final.request_id)
    finalizer = Finalizer(OneProducer(producer), token_topic="tokens",  # type: ignore[arg-type]
                          usage_topic="usage", group_id="g", offsets=offsets, claims=FakeClaims(), batch_max=8,
                          give_up_s=5)
    waits = [asyncio.ensure_future(finalizer.finish(first)), asyncio.ensure_future(finalizer.finish(second))]
    await asyncio.sleep(0)
    loop = asyncio.create_task(finalizer.run())
    await asyncio.gather(*waits)
    await finalizer.stop()
    await loop
    return producer, first, second


async def test_a_refused_final_second_in_its_batch_is_recorded_without_its_text() -> None:
    """The deliveries were awaited only when the offsets moved: retried alone after the batch failed, the second
    request's transaction had no offsets to commit (the first one's commit had taken them), committed its usage
    without its final, and the client's stream never ended."""
    producer, _, refused = await _one_refused(refused_second=True)
    finals = [e for t, e in producer.log if t == "tokens" and e.request_id == refused.final.request_id]
    assert len(finals) == 1, f"{len(finals)} finals committed for the refused request"
    assert isinstance(finals[0], TokenEvent) and finals[0].error_code == ErrorCode.GENERATION_FAILED.value


async def test_a_request_retried_alone_does_not_commit_its_sibling_as_finished() -> None:
    """Both requests were marked done before their deliveries failed: the first one's own commit then said the
    second's offset was finished while the second's final was not written yet; a crash between the two would
    skip it for good."""
    producer, _, _ = await _one_refused(refused_second=False)
    states = [decode_state(o[P0].offset, o[P0].metadata) for o in producer.offsets_sent]  # type: ignore[attr-defined]
    assert states and (1 in states[0].open or states[0].next <= 1), (
        f"the first commit says offset 1 is finished: {states[0]}")
    assert states[-1] == CommittedState(2, 2, frozenset())


class FencedAtCommit(TxnProducerStub):
    """aiokafka's own TransactionManager behind a producer whose first commit is fenced (EndTxn answered
    INVALID_PRODUCER_EPOCH): the manager is left in its fatal state, as the real sender leaves it."""

    def __init__(self) -> None:
        super().__init__()
        self._txn_manager = self._manager = TransactionManager("t", 60000)
        self._manager.set_pid_and_epoch(1, 0)

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[None]:
        self._manager.begin_transaction()  # as AIOKafkaProducer.begin_transaction: asserts a legal state
        yield
        self._manager.fatal_error(ProducerFenced())
        raise ProducerFenced()


async def test_a_request_of_a_partition_fenced_a_moment_ago_is_lost_not_fatal() -> None:
    """Found by the same review (older than the change): the fenced producer stays this worker's until the
    partition-lost handler (which first waits for the intake's admission lock) releases it; a request finished
    meanwhile began a transaction on it, aiokafka asserted FATAL_ERROR -> IN_TRANSACTION, and the AssertionError
    (no KafkaError) ended the commit loop: the whole worker stopped for one lost partition."""
    offsets = OffsetTracker()
    offsets.restore(P0, CommittedState(0, 0, frozenset()))
    offsets.taken(P0, 0)
    offsets.taken(P0, 1)
    release = asyncio.Event()

    async def on_lost(tp: TopicPartition) -> None:
        await release.wait()

    finalizer = Finalizer(OneProducer(FencedAtCommit()), token_topic="tokens",  # type: ignore[arg-type]
                          usage_topic="usage", group_id="g", offsets=offsets, claims=FakeClaims(), batch_max=8,
                          give_up_s=5, on_partition_lost=on_lost)
    loop = asyncio.create_task(finalizer.run())
    first, second = _finished(2, billed=True), _finished(3, billed=True)
    second.offset = 1
    for item in (first, second):
        with contextlib.suppress(PartitionLost):
            await finalizer.finish(item)
        assert item.committed.done() and isinstance(item.committed.exception(), PartitionLost)
    await asyncio.sleep(0)
    assert not loop.done(), f"the commit loop died: {loop.exception()!r}"
    release.set()
    await finalizer.stop()
    await loop


async def test_one_fencing_starts_one_partition_lost_handler() -> None:
    """Second review: every request finished on the fenced producer started another handler; a later one, run
    after a rebalance gave the partition back, would drop the new ownership."""
    offsets = OffsetTracker()
    offsets.restore(P0, CommittedState(0, 0, frozenset()))
    calls: list[TopicPartition] = []
    release = asyncio.Event()

    async def on_lost(tp: TopicPartition) -> None:
        calls.append(tp)
        await release.wait()

    finalizer = Finalizer(OneProducer(FencedAtCommit()), token_topic="tokens",  # type: ignore[arg-type]
                          usage_topic="usage", group_id="g", offsets=offsets, claims=FakeClaims(), batch_max=8,
                          give_up_s=5, on_partition_lost=on_lost)
    loop = asyncio.create_task(finalizer.run())
    for offset in range(3):
        offsets.taken(P0, offset)
        item = _finished(2, billed=True)
        item.offset = offset
        with contextlib.suppress(PartitionLost):
            await finalizer.finish(item)
    await asyncio.sleep(0)
    release.set()
    await finalizer.stop()
    await loop
    assert len(calls) == 1, f"{len(calls)} partition-lost handlers for one fencing"


class BrokerAway(TxnProducerStub):
    """A partition's producer whose every transaction fails with a transient error (the broker going away)."""

    def __init__(self) -> None:
        super().__init__()
        self.attempts = 0
        self.tried = asyncio.Event()

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[None]:
        self.attempts += 1
        self.tried.set()
        yield
        raise KafkaConnectionError("the broker is away")


async def _regained_while_retrying(committed_after: CommittedState) -> OffsetTracker:
    """A request's commit fails, and while its retry sleeps P0 is lost and regained (rebalance.py's release and
    gain: the tracker restarts from the broker's committed state, a new producer is acquired)."""
    offsets = OffsetTracker()
    offsets.restore(P0, CommittedState(0, 0, frozenset()))
    for offset in range(6):
        offsets.taken(P0, offset)
    old = BrokerAway()
    transactions = OneProducer(old)
    finalizer = Finalizer(transactions, token_topic="tokens", usage_topic="usage",  # type: ignore[arg-type]
                          group_id="g", offsets=offsets, claims=FakeClaims(), batch_max=8, give_up_s=60)
    loop = asyncio.create_task(finalizer.run())
    item = _finished(2, billed=True)
    item.offset = 5
    waiting = asyncio.ensure_future(finalizer.finish(item))
    await asyncio.wait_for(old.tried.wait(), 5)
    offsets.revoke([P0])
    new = transactions.current = BrokerAway()
    offsets.restore(P0, committed_after)
    with contextlib.suppress(PartitionLost):
        await asyncio.wait_for(waiting, 5)
    assert new.attempts == 0, "the previous ownership's request was committed on the new producer"
    await finalizer.stop()
    await loop
    return offsets


async def test_a_request_of_a_partition_lost_and_regained_leaves_the_new_ownership_alone() -> None:
    """Second review: the failed retry re-opened offset 5 in the restored state (``taken`` moved ``next`` to 6):
    records 0-4, open at the last commit and to be taken over, counted as seen and were dropped."""
    offsets = await _regained_while_retrying(CommittedState(0, 6, frozenset(range(6))))
    assert offsets.resume_at(P0) == 0
    assert offsets.classify(P0, 0) is Taken.NEW


async def test_a_reopen_below_the_committed_offset_is_ignored() -> None:
    """The same, where another worker had committed past the request: the re-opened offset below the committed
    one froze the partition's commits."""
    offsets = OffsetTracker()
    offsets.restore(P0, CommittedState(8, 8, frozenset()))
    offsets.reopen(P0, 5)
    offsets.taken(P0, 8)
    offsets.done(P0, 8)
    assert offsets.committable([P0]), "offset 8 finished, yet nothing is committable"


class HeldCommit(TxnProducerStub):
    """A partition's producer whose first transaction waits until ``release`` is set, then fails with a transient
    error (its broker went away meanwhile); counts the transactions begun on it."""

    def __init__(self) -> None:
        super().__init__()
        self.attempts = 0
        self.holding = asyncio.Event()
        self.release = asyncio.Event()

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[None]:
        self.attempts += 1
        if self.attempts == 1:
            self.holding.set()
            await self.release.wait()
            raise KafkaConnectionError("the broker went away")
        yield


async def test_a_request_queued_before_its_partition_was_lost_and_regained_is_not_committed_by_the_new_owner(
) -> None:
    """Ninth session (left open since the seventh): the finalizer stamped no ownership on what it queued. A request
    finished while the commit loop was busy with another stayed queued while its partition was lost and regained
    (rebalance.py's release, then a gain: a new producer, the offsets restored from the broker, the request to be
    taken over from its committed offset); the loop then committed it on the new producer: its final and usage
    beside the new ownership's takeover of the same request (two finals, billed twice)."""
    offsets = OffsetTracker()
    offsets.restore(P0, CommittedState(0, 0, frozenset()))
    offsets.taken(P0, 0)
    offsets.taken(P0, 1)
    old = HeldCommit()
    transactions = OneProducer(old)
    finalizer = Finalizer(transactions, token_topic="tokens", usage_topic="usage",  # type: ignore[arg-type]
                          group_id="g", offsets=offsets, claims=FakeClaims(), batch_max=8, give_up_s=60)
    loop = asyncio.create_task(finalizer.run())
    busy, queued = _finished(2, billed=True), _finished(3, billed=True)
    queued.offset = 1
    committing = asyncio.ensure_future(finalizer.finish(busy))
    await asyncio.wait_for(old.holding.wait(), 5)
    waiting = asyncio.ensure_future(finalizer.finish(queued))
    await asyncio.sleep(0)
    offsets.revoke([P0])  # lost ...
    new = transactions.current = HeldCommit()
    new.attempts = 1  # ... and regained: the new producer commits at once
    offsets.restore(P0, CommittedState(0, 0, frozenset()))
    old.release.set()
    for item in (committing, waiting):
        with contextlib.suppress(PartitionLost):
            await asyncio.wait_for(item, 5)
    assert new.attempts == 1, "a request of the previous ownership was committed on the new producer"
    assert isinstance(queued.committed.exception(), PartitionLost)
    assert offsets.resume_at(P0) == 0
    await finalizer.stop()
    await loop
