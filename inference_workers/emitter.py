"""The worker's outputs: token deltas as they come, and one transaction per batch of finished requests.

Deltas go through an idempotent producer straight to the requesting gateway's reply partition — a Kafka
transaction per token would cost milliseconds each. What must be exactly-once goes through the
:class:`Finalizer`: for each finished request, its final token event and its usage event, together with the
request topic's committable offsets, are produced in one transaction. A crash before the commit leaves
neither the usage nor the offset, so the request is redelivered and finalized again; after the commit the
claim is marked done and a redelivery is skipped. The final event is produced only after the request's last
delta is acknowledged, so it lands behind every delta in the partition.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaError, ProducerFenced
from redis.exceptions import RedisError

from inference_workers.claims import RequestClaims
from inference_workers.offsets import OffsetTracker
from runtime.metrics import WORKER_TXN, WORKER_TXN_BATCH
from runtime.tracing import to_headers
from schemas.codec import codec_for
from schemas.errors import FatalError
from schemas.events import TokenEvent, UsageEvent

log = logging.getLogger(__name__)

Delivery = asyncio.Future  # the broker's ack of one produced record


class TokenSink:
    """Produces non-final token events to a reply partition."""

    def __init__(self, producer: AIOKafkaProducer, topic: str) -> None:
        self._producer = producer
        self._topic = topic
        self._codec = codec_for(TokenEvent)

    async def emit(self, event: TokenEvent, partition: int, traceparent: str | None) -> Delivery:
        """Enqueue one event; returns its delivery future (awaited only before the request's final event)."""
        return await self._producer.send(
            self._topic, value=self._codec.encode(event), key=event.request_id.encode(), partition=partition,
            headers=to_headers(traceparent) if traceparent else None,
        )


@dataclass
class Finished:
    """A request ready to be committed."""

    final: TokenEvent
    usage: UsageEvent
    reply_partition: int
    source: TopicPartition
    offset: int
    traceparent: str | None
    last_delivery: Delivery | None
    committed: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class _OffsetsOnly:
    """Queue marker: commit offsets that moved without a finished request (skipped duplicates)."""


_OFFSETS_ONLY = _OffsetsOnly()
_STOP = object()


class Finalizer:
    def __init__(self, producer: AIOKafkaProducer, *, token_topic: str, usage_topic: str, group_id: str,
                 offsets: OffsetTracker, claims: RequestClaims, batch_max: int) -> None:
        self._producer = producer
        self._token_topic = token_topic
        self._usage_topic = usage_topic
        self._group_id = group_id
        self._offsets = offsets
        self._claims = claims
        self._batch_max = batch_max
        self._tokens = codec_for(TokenEvent)
        self._usage = codec_for(UsageEvent)
        self._queue: asyncio.Queue[object] = asyncio.Queue()
        self._offsets_pending = False

    async def finish(self, item: Finished) -> None:
        """Queue a finished request and wait until its transaction has committed."""
        self._queue.put_nowait(item)
        await asyncio.shield(item.committed)

    def commit_offsets_soon(self) -> None:
        if not self._offsets_pending:
            self._offsets_pending = True
            self._queue.put_nowait(_OFFSETS_ONLY)

    async def flush(self) -> None:
        """Return once everything queued so far is committed (rebalance, shutdown)."""
        await self._queue.join()

    async def stop(self) -> None:
        self._queue.put_nowait(_STOP)
        await self._queue.join()

    async def run(self) -> None:
        """The one commit loop. NOTE: it owns every transaction of this worker's producer."""
        while True:
            # 1. Take what is queued (at least one item), up to a batch.
            items = [await self._queue.get()]
            while len(items) < self._batch_max and not self._queue.empty():
                items.append(self._queue.get_nowait())
            stop = any(i is _STOP for i in items)
            batch = [i for i in items if isinstance(i, Finished)]
            self._offsets_pending = False
            # 2. Commit them, retrying transient failures.
            try:
                await self._commit_with_retry(batch)
            except BaseException as exc:
                for item in batch:
                    if not item.committed.done():
                        item.committed.set_exception(exc)
                raise
            finally:
                for _ in items:
                    self._queue.task_done()
            if stop:
                return

    async def _commit_with_retry(self, batch: list[Finished]) -> None:
        delay = 0.1
        while True:
            try:
                await self._commit(batch)
                return
            except ProducerFenced as exc:
                raise FatalError("another worker with this transactional id took over (fenced)") from exc
            except KafkaError as exc:
                log.warning("finalize transaction failed; retrying", extra={"reason": repr(exc), "batch": len(batch)})
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def _commit(self, batch: list[Finished]) -> None:
        if not batch and not self._offsets.committable():
            return
        # Deltas first: the final event must land behind them in the reply partition.
        for item in batch:
            if item.last_delivery is not None:
                try:
                    await item.last_delivery
                except KafkaError:
                    log.exception("a token delta was not delivered", extra={"request_id": item.final.request_id})
        started = time.perf_counter()
        async with self._producer.transaction():
            for item in batch:
                headers = to_headers(item.traceparent) if item.traceparent else None
                key = item.final.request_id.encode()
                await self._producer.send(self._token_topic, value=self._tokens.encode(item.final), key=key,
                                          partition=item.reply_partition, headers=headers)
                await self._producer.send(self._usage_topic, value=self._usage.encode(item.usage), key=key,
                                          headers=headers)
                self._offsets.done(item.source, item.offset)
            offsets = self._offsets.committable()
            if offsets:
                await self._producer.send_offsets_to_transaction(offsets, self._group_id)
        # NOTE: committed. Only now is a redelivery of these requests a duplicate.
        self._offsets.committed(offsets)
        WORKER_TXN.observe(time.perf_counter() - started)
        if batch:
            WORKER_TXN_BATCH.observe(len(batch))
            try:
                await self._claims.mark_done([item.final.request_id for item in batch])
            except RedisError:
                # A redelivery may then generate again; the usage ledger is keyed by request id, so billing
                # stays exact. Logged, not fatal.
                log.exception("could not mark requests done", extra={"batch": len(batch)})
        for item in batch:
            if not item.committed.done():
                item.committed.set_result(None)
