"""The worker's commits: one transaction per request partition for finished requests.

Deltas go through an idempotent producer straight to the requesting gateway's reply partition, one record per
engine step per partition (``token_sink.py``): a Kafka transaction per token would cost milliseconds each. What
must be exactly-once goes through the :class:`Finalizer`: a finished request's final token event and its usage
event, together with its request partition's committable offset (and state, see ``offsets.py``), are produced in
one transaction by that partition's own producer (``transactions.py``), so an owner that lost the partition is
fenced. A crash before the commit leaves neither usage nor offset: the request is taken over again. The final
event is produced only after the request's last delta is acknowledged, so it lands behind every delta in the
reply partition.

Failures, by kind: a fenced producer means the partition moved (its requests are the new owner's now, not an
error); a producer left unusable otherwise stops the worker (re-initialising its transactional id could fence the
partition's rightful owner); transient errors are retried with backoff, and the worker stops (non-zero, its
supervisor restarts it, its partitions move) when they last longer than ``give_up_s``; an error retrying cannot fix
is isolated to the one request that causes it, whose final is then recorded without its text (nor its tokens'
cost), so one bad record never blocks the others.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass, field

from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.errors import (
    IllegalOperation,
    KafkaConnectionError,
    KafkaError,
    KafkaTimeoutError,
    NodeNotReadyError,
    ProducerFenced,
    RequestTimedOutError,
)
from aiokafka.structs import OffsetAndMetadata
from redis.exceptions import RedisError

from inference_workers.offsets import OffsetTracker
from inference_workers.protocol import ClaimsT, SettlementsT
from inference_workers.transactions import PartitionTransactions
from runtime.faults import NO_FAULTS, Faults
from runtime.metrics import LIMITER_SETTLED, WORKER_FINALIZE_FAILURES, WORKER_TXN, WORKER_TXN_BATCH
from runtime.tracing import to_headers
from schemas.codec import codec_for
from schemas.errors import FatalError
from schemas.events import ErrorCode, StoredCompletion, TokenEvent, UsageEvent

log = logging.getLogger(__name__)

Delivery = asyncio.Future  # the broker's ack of one produced record
PartitionLostCallback = Callable[[TopicPartition], Coroutine[object, object, None]]


def transient(exc: BaseException) -> bool:
    """Retrying can succeed (a broker restarting, a leader moving, a timeout)."""
    return bool(getattr(exc, "retriable", False)) or isinstance(
        exc, KafkaTimeoutError | KafkaConnectionError | NodeNotReadyError | RequestTimedOutError)


class PartitionLost(Exception):
    """The request partition moved to another worker before this commit: its new owner finishes the request."""


@dataclass
class Finished:
    """A request ready to be committed. ``usage`` is None for one that is not billed (never started)."""

    final: TokenEvent
    usage: UsageEvent | None
    reply_partition: int
    source: TopicPartition
    offset: int
    traceparent: str | None
    last_delivery: Delivery | None
    committed: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    #: the completion to record (``store: true``, or a turn), written in the same transaction as the final
    stored: StoredCompletion | None = None
    #: the partition's producer when the request was handed over: its ownership, the only one it commits under
    owner: AIOKafkaProducer | None = None

    def without_text(self, reason: str) -> Finished:
        """The same outcome, recorded without its text: what remains when the full final cannot be written. The
        tokens it carried never reach the client, so they are not billed either."""
        dropped = len(self.final.token_ids)
        usage = self.final.usage
        if usage is not None:
            usage = usage.model_copy(update={"completion_tokens": usage.completion_tokens - dropped})
        final = self.final.model_copy(update={"token_ids": [], "text": "", "finish_reason": "error", "usage": usage,
                                              "error": reason, "error_code": ErrorCode.GENERATION_FAILED.value})
        record = self.usage
        if record is not None:
            record = record.model_copy(update={"completion_tokens": record.completion_tokens - dropped,
                                               "finish_reason": "error"})
        # Recorded without its text (what made the final unwritable, its size usually, would refuse a copy with
        # it): a turn's end must still be known (its response row, its conversation's next turn, its held slot).
        stored = self.stored and self.stored.model_copy(update={
            "text": "", "finish_reason": "error", "error": reason,
            "usage": self.stored.usage.model_copy(update={"completion_tokens": self.stored.usage.completion_tokens
                                                                              - dropped})})
        return Finished(final, record, self.reply_partition, self.source, self.offset, self.traceparent, None,
                        self.committed, stored=stored, owner=self.owner)


_STOP = object()
#: settlements kept for retry while Redis is away, at most (the oldest are dropped: their reservations expire)
MAX_UNSETTLED = 100_000


class Finalizer:
    def __init__(self, transactions: PartitionTransactions, *, token_topic: str, usage_topic: str, group_id: str,
                 stored_topic: str | None = None,
                 offsets: OffsetTracker, claims: ClaimsT, batch_max: int, give_up_s: float,
                 on_partition_lost: PartitionLostCallback | None = None, faults: Faults = NO_FAULTS,
                 settlements: SettlementsT | None = None, token_version: int | None = None) -> None:
        self._transactions = transactions
        self._settlements = settlements
        #: settlements Redis did not take yet (retried with backoff by ``_settle_retry``)
        self._unsettled: list[tuple[str, int, bool]] = []
        self._settle_retry: asyncio.Task[None] | None = None
        self._token_topic = token_topic
        self._usage_topic = usage_topic
        self._stored_topic = stored_topic
        self._stored = codec_for(StoredCompletion)
        self._group_id = group_id
        self._offsets = offsets
        self._claims = claims
        self._batch_max = batch_max
        self._give_up_s = give_up_s
        self._on_partition_lost = on_partition_lost
        self._faults = faults
        self._tokens = codec_for(TokenEvent)
        #: the token record version of finals, as of deltas (``worker.token_record_version``: the upgrade path)
        self._version = token_version
        self._usage = codec_for(UsageEvent)
        self._queue: asyncio.Queue[object] = asyncio.Queue()
        #: partitions whose offsets moved without a finished request (skipped records)
        self._offsets_due: set[TopicPartition] = set()
        self._stalled_since: float | None = None
        self._lost_tasks: set[asyncio.Task[None]] = set()
        self._exited = False

    def set_partition_lost(self, callback: PartitionLostCallback) -> None:
        self._on_partition_lost = callback

    async def finish(self, item: Finished) -> None:
        """Queue a finished request and wait until its transaction has committed (raises PartitionLost)."""
        item.owner = self._transactions.producer(item.source)
        self._queue.put_nowait(item)
        await asyncio.shield(item.committed)

    def commit_offsets_soon(self, tp: TopicPartition) -> None:
        if not self._offsets_due:
            self._queue.put_nowait(None)  # wake the loop
        self._offsets_due.add(tp)

    async def flush(self, timeout_s: float | None = None) -> None:
        """Return once everything queued so far is committed or has failed (rebalance, shutdown)."""
        try:
            await asyncio.wait_for(self._queue.join(), timeout_s)
        except TimeoutError:
            log.warning("finalizer flush timed out", extra={"timeout_s": timeout_s})

    async def stop(self) -> None:
        if not self._exited:  # else the loop died (its error stops the worker): nobody would take the stop marker
            self._queue.put_nowait(_STOP)
            await self._queue.join()
        if self._settle_retry is not None and not self._settle_retry.done():
            self._settle_retry.cancel()
            if self._unsettled and not await self._flush_settlements():
                log.error("rate-limit settlements lost at stop", extra={"pending": len(self._unsettled)})
            if self._settle_retry is not None:
                self._settle_retry.cancel()

    def stalled_for(self) -> float:
        """Seconds the finalizer has been retrying without a commit (0: not stalled): unhealthy when long."""
        return 0.0 if self._stalled_since is None else time.monotonic() - self._stalled_since

    async def run(self) -> None:
        """The one commit loop. NOTE: it owns every transaction of every partition producer of this worker."""
        try:
            await self._loop()
        finally:
            self._exited = True

    async def _loop(self) -> None:
        while True:
            # 1. Take what is queued (at least one item), up to a batch.
            items = [await self._queue.get()]
            while len(items) < self._batch_max and not self._queue.empty():
                items.append(self._queue.get_nowait())
            batch = [i for i in items if isinstance(i, Finished)]
            partitions = {i.source for i in batch} | self._offsets_due
            self._offsets_due = set()
            # 2. One transaction per request partition, all partitions at once.
            try:
                await asyncio.gather(*(self._commit_partition(tp, [i for i in batch if i.source == tp])
                                       for tp in sorted(partitions)))
            except BaseException as exc:
                for item in batch:
                    if not item.committed.done():
                        item.committed.set_exception(exc)
                raise
            finally:
                for _ in items:
                    self._queue.task_done()
            if any(i is _STOP for i in items):
                return

    async def _commit_partition(self, tp: TopicPartition, items: list[Finished]) -> None:
        delay = 0.1
        isolated = False
        owner = self._transactions.producer(tp)
        # Queued before the partition was lost (and maybe regained since): the new ownership takes them over from
        # its committed offset, so they must not commit beside it.
        _fail([i for i in items if i.owner is not owner], _moved(tp))
        items = [i for i in items if i.owner is owner]
        while True:
            if owner is None or self._transactions.producer(tp) is not owner:
                # Gone, or lost and regained while this retry slept: the records are the new ownership's to take.
                return _fail(items, _moved(tp))
            producer: AIOKafkaProducer = owner
            if _fenced(producer):
                # Fenced by an earlier commit whose partition-lost handler runs already (and has not released the
                # producer yet): aiokafka would refuse a new transaction on it with an AssertionError.
                return _fail(items, PartitionLost(f"partition {tp.partition} moved to another worker"))
            try:
                await self._commit(producer, tp, items)
            except ProducerFenced:
                log.warning("fenced: partition moved to another worker", extra={"partition": tp.partition})
                _fail(items, PartitionLost(f"partition {tp.partition} moved to another worker"))
                if self._on_partition_lost is not None:
                    # A task: the handler stops this partition's requests, which may wait on this very loop.
                    task = asyncio.create_task(self._on_partition_lost(tp), name=f"partition-lost-{tp.partition}")
                    self._lost_tasks.add(task)
                    task.add_done_callback(self._lost_tasks.discard)
                return None
            except KafkaError as exc:
                if producer._txn_manager.is_fatal_error():  # aiokafka has no public check for it
                    # Not a fencing this worker can act on, and re-initialising the id could fence the partition's
                    # rightful owner: stop, be restarted, rejoin the group cleanly.
                    raise FatalError(f"the producer of partition {tp.partition} is unusable: {exc!r}") from exc
                if not transient(exc):
                    WORKER_FINALIZE_FAILURES.labels(kind="permanent").inc()
                    if len(items) > 1 and not isolated:
                        # Find the one that cannot be written; the others commit.
                        for item in items:
                            await self._commit_partition(tp, [item])
                        return None
                    if items and not isolated:
                        isolated = True
                        log.error("a final cannot be written; recording it without its text",
                                  extra={"request_id": items[0].final.request_id, "reason": repr(exc)})
                        items = [items[0].without_text("the final event could not be written")]  # why: logged above
                        continue
                    raise FatalError(f"cannot commit on partition {tp.partition}: {exc!r}") from exc
                WORKER_FINALIZE_FAILURES.labels(kind="transient").inc()
                self._stalled_since = self._stalled_since or time.monotonic()
                if self.stalled_for() > self._give_up_s:
                    raise FatalError(f"no commit succeeded for {self._give_up_s:.0f} s: {exc!r}") from exc
                log.warning("finalize transaction failed; retrying", extra={"reason": repr(exc), "batch": len(items),
                                                                            "partition": tp.partition})
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
                continue
            self._stalled_since = None
            await self._committed(items)
            return None

    async def _commit(self, producer: AIOKafkaProducer, tp: TopicPartition, items: list[Finished]) -> None:
        if not items and not self._offsets.committable([tp]):
            return
        # Deltas first: the final event must land behind them in the reply partition.
        for item in items:
            if item.last_delivery is not None:
                await asyncio.gather(item.last_delivery, return_exceptions=True)  # a failure was handled already
        started = time.perf_counter()
        try:
            offsets = await self._write(producer, items, tp)
        except IllegalOperation as exc:
            # The sender hit the real failure (a fencing, usually) while this coroutine was between sends: aiokafka
            # records it on the transaction and refuses the next send with IllegalOperation. Raise what happened.
            raise (_recorded_failure(producer) or FatalError(f"transaction refused: {exc!r}")) from exc
        # NOTE: committed. Only now is a redelivery of these requests a duplicate.
        self._offsets.committed(offsets)
        WORKER_TXN.observe(time.perf_counter() - started)
        if items:
            WORKER_TXN_BATCH.observe(len(items))

    async def _write(self, producer: AIOKafkaProducer, items: list[Finished], tp: TopicPartition
                     ) -> dict[TopicPartition, OffsetAndMetadata]:
        """One transaction: the finals, their usage, the partition's offset and state. Returns what it committed."""
        try:
            async with producer.transaction():
                # Every record acknowledged before anything else joins the transaction. A record the broker refuses
                # fails its own delivery only (aiokafka would commit the rest without it). And the broker checks a
                # transaction's first record on each partition with the coordinator, which refuses the check while
                # it adds the offsets' group: Kafka 4 tells pre-KIP-890 producers (aiokafka) NOT_ENOUGH_REPLICAS
                # and the records wait out a 100 ms retry (DEVELOPERS.md, "Kafka / aiokafka").
                await asyncio.gather(*[await send for send in self._sends(producer, items)])
                for item in items:
                    self._offsets.done(item.source, item.offset)
                offsets = self._offsets.committable([tp])
                if offsets:
                    await producer.send_offsets_to_transaction(offsets, self._group_id)
                if items and self._faults.enabled:
                    await producer.flush()  # the finals are on the broker, uncommitted: what a crash here leaves
                    self._faults.hit("finalize.before_commit")
        except BaseException:
            # Not finished until their own transaction commits: a sibling's commit must not say they are.
            for item in items:
                self._offsets.reopen(item.source, item.offset)
            raise
        return offsets

    def _sends(self, producer: AIOKafkaProducer, items: list[Finished]) -> Iterator[Awaitable[Delivery]]:
        """What one transaction sends for ``items``: each final, its usage and its stored completion."""
        for item in items:
            headers = to_headers(item.traceparent) if item.traceparent else None
            key = item.final.request_id.encode()
            yield producer.send(self._token_topic, value=self._tokens.encode(item.final, version=self._version),
                                key=key, partition=item.reply_partition, headers=headers)
            if item.usage is not None:
                yield producer.send(self._usage_topic, value=self._usage.encode(item.usage), key=key,
                                    headers=headers)
            if item.stored is not None and self._stored_topic is not None:
                yield producer.send(self._stored_topic, value=self._stored.encode(item.stored), key=key,
                                    headers=headers)

    async def _committed(self, items: list[Finished]) -> None:
        if items:
            # Settled first: the gap between the commit and the settlement is what a SIGKILL can lose.
            await self._settle(items)
            try:
                await self._claims.mark_done([item.final.request_id for item in items])
            except (RedisError, OSError):
                # The commit's offset state says the same (offsets.py); the claim only saves a lookup. Logged.
                log.warning("could not mark requests done in their claims", extra={"batch": len(items)})
        for item in items:
            if not item.committed.done():
                item.committed.set_result(None)

    async def _settle(self, items: list[Finished]) -> None:
        """Tell the rate limiter what each request used: what was just committed, so billed exactly once."""
        if self._settlements is None:
            return
        self._unsettled += [(item.final.request_id, _used(item.usage), item.usage is not None) for item in items]
        del self._unsettled[:-MAX_UNSETTLED]
        await self._flush_settlements()

    async def _flush_settlements(self) -> bool:
        assert self._settlements is not None
        pending, self._unsettled = self._unsettled, []
        try:
            settled = await self._settlements.settle_many(pending)
        except (RedisError, OSError):
            # Kept and retried: the offsets are committed, so nothing else will ever settle these requests.
            self._unsettled = pending + self._unsettled
            log.warning("could not settle rate-limit reservations; retrying", extra={"pending": len(pending)})
            if self._settle_retry is None or self._settle_retry.done():
                self._settle_retry = asyncio.create_task(self._retry_settlements(), name="settle-retry")
            return False
        LIMITER_SETTLED.inc(settled)
        return True

    async def _retry_settlements(self) -> None:
        delay = 0.5
        while self._unsettled:
            await asyncio.sleep(delay)
            if await self._flush_settlements():
                return
            delay = min(delay * 2, 30.0)


def _used(usage: UsageEvent | None) -> int:
    return 0 if usage is None else usage.prompt_tokens + usage.completion_tokens


def _recorded_failure(producer: AIOKafkaProducer) -> BaseException | None:
    """The error aiokafka's transaction manager recorded for the current transaction (None: none)."""
    waiter = producer._txn_manager.wait_for_transaction_end()
    if waiter.done() and not waiter.cancelled():
        return waiter.exception()
    return None


def _fenced(producer: AIOKafkaProducer) -> bool:
    """The producer was fenced (a newer owner took its transactional id over): it can begin no transaction."""
    return producer._txn_manager.is_fatal_error() and isinstance(_recorded_failure(producer), ProducerFenced)


def _moved(tp: TopicPartition) -> PartitionLost:
    return PartitionLost(f"partition {tp.partition} is no longer this worker's")


def _fail(items: list[Finished], exc: Exception) -> None:
    for item in items:
        if not item.committed.done():
            item.committed.set_exception(exc)
