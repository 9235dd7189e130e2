"""The SSE relay's demultiplexer: one consumer task per gateway process, one collector per request.

The gateway claims a reply partition, the relay tails it from its end (records before the gateway started
belong to requests whose clients are gone) and routes each token event to its request's collector.
Register a request *before* producing it and unregister in ``finally``; events for unknown ids (a request
whose client already left) are counted and dropped.

The relay reads ``read_uncommitted``: token deltas are not transactional (a transaction per token would
cost milliseconds each) and only a request's final event rides in the worker's transaction; waiting for
that transaction would stall every stream behind it. A final the client saw from a transaction that then
aborted is still the outcome: the worker retries the same commit, or the request's next owner finalizes what
the log shows (``inference_workers/prefix.py``). Which events count is the collector's
(``schemas/token_stream.py``). A record this gateway cannot decode is dead-lettered, and its request (the
record key) ends at once with an error rather than waiting out a timeout.
"""

from __future__ import annotations

import asyncio
import logging
import time

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition

from producers.relay.collector import StreamCollector
from runtime.dead_letters import DeadLetters
from runtime.kafka_clients import consume, make_consumer
from runtime.metrics import KAFKA_HOP, RELAY_EVENTS, RELAY_STREAMS
from runtime.settings import KafkaSettings
from schemas.codec import codec_for
from schemas.errors import DecodeError
from schemas.events import ErrorCode, TokenEvent

log = logging.getLogger(__name__)


class Relay:
    def __init__(self, kafka: KafkaSettings, topic: str, partition: int,
                 dead_letters: DeadLetters | None = None) -> None:
        self._kafka = kafka
        self._dead_letters = dead_letters
        self.partition = TopicPartition(topic, partition)
        self._streams: dict[str, StreamCollector] = {}
        self._consumer: AIOKafkaConsumer | None = None
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._hop = KAFKA_HOP.labels(hop="worker_to_relay")
        self._routed = RELAY_EVENTS.labels(kind="routed")
        self._unknown = RELAY_EVENTS.labels(kind="unknown_request")
        self._duplicate = RELAY_EVENTS.labels(kind="duplicate")

    async def start(self, from_offset: int | None = None) -> None:
        """Tail the partition from its end (``from_offset``: from there instead; benchmarks replay a backlog)."""
        consumer = make_consumer(self._kafka, role="relay", isolation="read_uncommitted",
                                 max_partition_fetch_bytes=4 * 1024 * 1024)
        await consumer.start()
        consumer.assign([self.partition])
        if from_offset is None:
            await consumer.seek_to_end(self.partition)
        else:
            consumer.seek(self.partition, from_offset)
        # Resolve the position now: a request produced after start() must not be missed.
        position = await consumer.position(self.partition)
        self._consumer = consumer
        self._task = asyncio.create_task(self._run(consumer), name="relay")
        log.info("relay tailing", extra={"topic": self.partition.topic, "partition": self.partition.partition,
                                         "offset": position})

    async def _run(self, consumer: AIOKafkaConsumer) -> None:
        try:
            await consume(consumer, codec_for(TokenEvent), self._route, stop=self._stop, poll_timeout_ms=200,
                          undecodable=self._undecodable)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("relay consumer failed; ending every open stream")
            self._fail_all("the gateway's token relay failed", ErrorCode.GATEWAY_STOPPING)
            raise

    async def _undecodable(self, record: ConsumerRecord[bytes, bytes], exc: DecodeError) -> None:
        collector = self._streams.get(record.key.decode(errors="replace")) if record.key else None
        if collector is not None:
            collector.fail(f"this gateway cannot read a token event of the request ({exc})",
                           ErrorCode.UNDECODABLE_EVENT)
        if self._dead_letters is not None:
            await self._dead_letters.send(record, str(exc))

    async def _route(self, event: TokenEvent, _record: ConsumerRecord[bytes, bytes]) -> None:
        if event.emitted_at_us:
            self._hop.observe(max(0.0, time.time() - event.emitted_at_us / 1e6))
        collector = self._streams.get(event.request_id)
        if collector is None:
            self._unknown.inc()
            return
        if collector.put(event):
            self._routed.inc()
        else:
            self._duplicate.inc()

    @property
    def healthy(self) -> bool:
        return self._task is not None and not self._task.done()

    def register(self, request_id: str) -> StreamCollector:
        if request_id in self._streams:
            raise ValueError(f"request {request_id} is already registered")
        collector = StreamCollector(request_id)
        self._streams[request_id] = collector
        RELAY_STREAMS.set(len(self._streams))
        return collector

    def unregister(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        RELAY_STREAMS.set(len(self._streams))

    def _fail_all(self, reason: str, code: str) -> None:
        for collector in self._streams.values():
            collector.fail(reason, code)

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
        self._fail_all("the gateway is shutting down", ErrorCode.GATEWAY_STOPPING)
        if self._consumer is not None:
            await self._consumer.stop()
