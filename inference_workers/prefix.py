"""Reads what a request has emitted so far, from its reply partition, exactly as its client's relay merged it.

A worker taking a request over (a failover, a rebalance, a retried finalization) must continue from what the
client already has. That is whatever the request's token events on its reply partition add up to under
:class:`schemas.token_stream.TokenStream`, the relay's own merge, read ``read_uncommitted`` as the relay reads.
A final event an earlier attempt wrote inside a transaction that then aborted is seen too: its client saw it,
so the takeover finalizes that same outcome instead of generating again.

Where to start reading: the offset of the request's first token event when its claim recorded it, else the
first record the broker appended at or after the request's creation time (minus a margin for the gateway's clock).
"""

from __future__ import annotations

import asyncio
import logging
import time

from aiokafka import AIOKafkaConsumer, TopicPartition

from inference_workers.resume import EmittedPrefix
from runtime.kafka_clients import make_consumer, stop_consumer
from runtime.settings import KafkaSettings
from schemas.codec import codec_for
from schemas.errors import DecodeError
from schemas.events import ChatRequest, TokenEvent
from schemas.token_batch import may_carry
from schemas.token_stream import TokenStream

log = logging.getLogger(__name__)

#: how far the gateway's clock (the request's creation time) may run ahead of the broker's, which stamps token
#: events (the token topic uses LogAppendTime, so workers' clocks do not matter)
CLOCK_SKEW_S = 30.0


class PrefixReader:
    def __init__(self, kafka: KafkaSettings, topic: str, *, timeout_s: float = 30.0) -> None:
        self._kafka = kafka
        self._topic = topic
        self._timeout_s = timeout_s
        self._consumer: AIOKafkaConsumer | None = None
        # One consumer, one read at a time: takeovers are rare, and a read is one partition scan.
        self._lock = asyncio.Lock()
        self._codec = codec_for(TokenEvent)

    async def start(self) -> None:
        self._consumer = make_consumer(self._kafka, role="worker-prefix", isolation="read_uncommitted",
                                       max_partition_fetch_bytes=4 * 1024 * 1024)
        await self._consumer.start()

    async def stop(self) -> None:
        if self._consumer is not None:
            await stop_consumer(self._consumer)

    async def read(self, request: ChatRequest, first_offset: int | None) -> EmittedPrefix:
        assert self._consumer is not None, "start() first"
        tp = TopicPartition(self._topic, request.reply.partition)
        async with self._lock:
            started = time.perf_counter()
            prefix = await asyncio.wait_for(self._scan(self._consumer, tp, request, first_offset), self._timeout_s)
        log.info("emitted prefix read", extra={"request_id": request.request_id, "tokens": prefix.tokens,
                                               "attempt_seen": prefix.attempt, "finished": prefix.final is not None,
                                               "ms": round((time.perf_counter() - started) * 1000, 1)})
        return prefix

    async def _scan(self, consumer: AIOKafkaConsumer, tp: TopicPartition, request: ChatRequest,
                    first_offset: int | None) -> EmittedPrefix:
        consumer.assign([tp])
        end = (await consumer.end_offsets([tp]))[tp]
        start = first_offset if first_offset is not None else await self._start_by_time(consumer, tp, request, end)
        stream = TokenStream(request.request_id)
        key = request.request_id.encode()
        text: list[str] = []
        consumer.seek(tp, start)
        while await consumer.position(tp) < end:
            batch = await consumer.getmany(tp, timeout_ms=1000)
            for record in batch.get(tp, ()):
                if record.value is None or (record.key != key if record.key is not None
                                            else not may_carry(record.value, key)):
                    continue
                try:
                    events = self._codec.decode(record.value).split()
                except DecodeError:
                    continue
                for event in events:
                    if event.request_id != request.request_id:
                        continue
                    accepted = stream.put(event)
                    if accepted is not None and accepted.text:
                        text.append(accepted.text)
        return EmittedPrefix(list(stream.token_ids), "".join(text), stream.attempt, stream.final, stream.error)

    @staticmethod
    async def _start_by_time(consumer: AIOKafkaConsumer, tp: TopicPartition, request: ChatRequest,
                             end: int) -> int:
        since_ms = int((request.created_at.timestamp() - CLOCK_SKEW_S) * 1000)
        found = (await consumer.offsets_for_times({tp: since_ms})).get(tp)
        return end if found is None else found.offset
