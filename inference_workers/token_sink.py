"""The worker's token deltas on their way to the reply partitions: one Kafka record per engine step per partition.

Every running request's task hands its delta to :meth:`TokenSink.emit` as the engine step's outputs arrive. The
engine wakes all of a step's tasks in one turn of the event loop, so the deltas emitted in that turn are produced
together, on the next turn: one record per reply partition carrying every request's delta (``schemas/token_batch.py``),
each with its own ``seq``. Nothing waits for company (no linger): the records of a step leave as soon as the step's
deltas are in. While a produce is being handed to the producer (its buffer full: the broker is slow), the next
steps' deltas gather behind it and leave together, so a slow broker gets fewer, larger records instead of a queue.

Each emit returns the delivery future of the record that carries it, shared by every request in that record: the
intake watches it (a record the broker did not take ends each of its streams at that delta, ``intake.py``) and the
finalizer waits for a request's last one before producing its final, so the final lands behind every delta.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from aiokafka import AIOKafkaProducer

from inference_workers.emitter import Delivery
from runtime.metrics import WORKER_TOKEN_RECORDS, WORKER_TOKENS_OUT
from runtime.tracing import to_headers
from schemas.codec import codec_for
from schemas.events import TokenEvent
from schemas.token_batch import Delta, pack

log = logging.getLogger(__name__)

#: the token record version written by default; 2 writes one request per record (readers not upgraded yet)
BATCHED_VERSION = 3


@dataclass
class _Record:
    """The deltas bound for one reply partition, produced together."""

    events: list[TokenEvent | Delta] = field(default_factory=list)
    traceparent: str | None = None
    delivered: Delivery = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class TokenSink:
    """Produces non-final token events, those of one engine step to one reply partition in one record."""

    def __init__(self, producer: AIOKafkaProducer, topic: str, *, version: int = BATCHED_VERSION,
                 max_events: int = 256) -> None:
        if version < BATCHED_VERSION:
            max_events = 1
        self._producer = producer
        self._topic = topic
        self._version = version
        self._max_events = max_events
        self._codec = codec_for(TokenEvent)
        #: records still to produce, by reply partition, in the order they were opened
        self._open: dict[int, _Record] = {}
        self._queued: list[tuple[int, _Record]] = []
        self._sender: asyncio.Task[None] | None = None

    async def emit(self, event: TokenEvent | Delta, partition: int, traceparent: str | None) -> Delivery:
        """Add one event to its partition's next record; returns that record's delivery future."""
        record = self._open.get(partition)
        if record is None or len(record.events) >= self._max_events:
            record = self._open[partition] = _Record(traceparent=traceparent)
            self._queued.append((partition, record))
        record.events.append(event)
        if self._sender is None or self._sender.done():
            # Starts on the next turn of the loop, once every task the engine step woke has emitted.
            self._sender = asyncio.create_task(self._send_queued(), name="token-sink")
        return record.delivered

    async def _send_queued(self) -> None:
        try:
            while self._queued:
                partition, record = self._queued[0]
                if self._open.get(partition) is record:
                    del self._open[partition]  # full or not, it leaves now: later deltas open the next one
                await self._send(partition, record)
                self._queued.pop(0)
        except asyncio.CancelledError:
            # Stopping: what was not handed to the producer is not delivered (the requests are taken over).
            for _, record in self._queued:
                if not record.delivered.done():
                    record.delivered.cancel()
            self._queued.clear()
            self._open.clear()
            raise

    async def _send(self, partition: int, record: _Record) -> None:
        events = record.events
        single = len({e.request_id for e in events}) == 1
        try:
            value = self._codec.encode_dict(pack(events), version=self._version)
            acked = await self._producer.send(
                self._topic, value=value, partition=partition,
                # One request: keyed, so readers after another request skip it undecoded (a packed one says it by
                # its bytes, token_batch.may_carry); its trace context rides along (a packed one has many).
                key=events[0].request_id.encode() if single else None,
                headers=to_headers(record.traceparent) if single and record.traceparent else None,
            )
        except Exception as exc:  # an unencodable or unsendable record: its streams end at this delta
            log.error("token record not produced", extra={"partition": partition, "events": len(events),
                                                          "reason": repr(exc)})
            if not record.delivered.done():
                record.delivered.set_exception(exc)
            return
        WORKER_TOKEN_RECORDS.observe(len(events))
        WORKER_TOKENS_OUT.inc(sum(len(e.token_ids) for e in events))  # once per record, not per delta
        acked.add_done_callback(lambda done: _settle(record.delivered, done))

    async def close(self) -> None:
        """Hand every record still waiting to the producer (its ``stop()`` then flushes them)."""
        if self._sender is not None:
            await asyncio.gather(self._sender, return_exceptions=True)


def _settle(delivered: Delivery, acked: asyncio.Future[object]) -> None:
    if delivered.done():
        return
    if acked.cancelled():
        delivered.cancel()
    elif acked.exception() is not None:
        delivered.set_exception(acked.exception())  # type: ignore[arg-type]
    else:
        delivered.set_result(acked.result())
