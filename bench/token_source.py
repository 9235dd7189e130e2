"""A lean stand-in for the workers in ``kns bench relay --source tokens``: what a worker writes, at the least CPU.

Item 2 of the transport issue asks what one gateway process relays. On this 2-core machine the gateway has one
core and the whole load the other, and a synthetic-engine worker spends about 45 µs per delta (its intake, one
task per request, the engine's clock), so the load core, not the gateway, set every figure. This process takes
the admitted requests from the work queues and, on one clock, hands a delta of every running request to the
worker's own :class:`~inference_workers.token_sink.TokenSink`: the same v3 records (one per step per reply
partition, packed by ``schemas/token_batch.py``), keys and partitions a worker produces. A request's final (its
usage, ``finish_reason: length``) follows its last delta's record, keyed by its id, as a worker's finalizer
writes it; no transaction, no usage event, no stored record, no failover: none of that is on the relay's path.

``python -m bench.token_source PORT RATE`` (the namespace and Kafka from the ``KNS_*`` environment, as every
service); ``/metrics`` (any path: health too) on PORT counts ``kns_worker_tokens_out_total`` like a worker.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from dataclasses import dataclass

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from prometheus_client import start_http_server

from inference_workers.token_sink import TokenSink
from runtime.kafka_clients import make_consumer, make_producer
from runtime.settings import Settings
from schemas.codec import codec_for
from schemas.events import ChatRequest, TokenEvent, TokenUsage
from schemas.token_batch import Delta
from schemas.topics import TOPICS

log = logging.getLogger(__name__)

WORKER_ID = "bench-token-source"
ATTEMPT = 1
TEXT = " tok"


@dataclass
class _Running:
    request_id: str
    partition: int
    max_tokens: int
    prompt_tokens: int
    made: int = 0


class TokenSource:
    """Every running request gets one token per step of one clock (``rate`` steps per second)."""

    def __init__(self, settings: Settings, rate: float) -> None:
        self._kafka = settings.kafka
        self._period_s = 1 / rate
        self._topic = self._kafka.topic(TOPICS.tokens.name)
        self._running: dict[str, _Running] = {}
        self._requests = codec_for(ChatRequest)
        self._finals = codec_for(TokenEvent)
        self._finishing: set[asyncio.Task[None]] = set()

    async def run(self) -> None:
        consumer = make_consumer(self._kafka, role="bench-token-source", group="bench-token-source",
                                 isolation="read_committed")
        producer = make_producer(self._kafka, role="bench-token-source")
        await producer.start()
        await consumer.start()
        try:
            consumer.subscribe([self._kafka.topic(spec.name) for spec in TOPICS.work_queues()])
            sink = TokenSink(producer, self._topic)
            await asyncio.gather(self._intake(consumer), self._steps(sink, producer))
        finally:
            await consumer.stop()
            await producer.stop()

    async def _intake(self, consumer: AIOKafkaConsumer) -> None:
        while True:
            batch = await consumer.getmany(timeout_ms=100)
            for records in batch.values():
                for record in records:
                    if record.value is None:
                        continue
                    request = self._requests.decode(record.value)
                    self._running[request.request_id] = _Running(
                        request.request_id, request.reply.partition, request.sampling.max_tokens,
                        len(request.prompt_token_ids))

    async def _steps(self, sink: TokenSink, producer: AIOKafkaProducer) -> None:
        """One clock for every request (as the synthetic engine's): its deltas leave in one record per partition."""
        loop = asyncio.get_running_loop()
        next_step = loop.time()
        while True:
            next_step += self._period_s
            await asyncio.sleep(max(0.0, next_step - loop.time()))
            now_us = time.time_ns() // 1000
            done = []
            for running in list(self._running.values()):
                delivered = await sink.emit(Delta(running.request_id, ATTEMPT, running.made, running.made,
                                                  [running.made % 1000 + 10], TEXT, WORKER_ID, now_us),
                                            running.partition, None)
                running.made += 1
                if running.made >= running.max_tokens:
                    del self._running[running.request_id]
                    done.append((running, delivered))
            for running, delivered in done:
                task = asyncio.create_task(self._finish(producer, running, delivered))
                self._finishing.add(task)
                task.add_done_callback(self._finishing.discard)

    async def _finish(self, producer: AIOKafkaProducer, running: _Running, delivered: asyncio.Future[object]) -> None:
        await delivered  # behind its last delta, as a worker's finalizer writes it
        final = TokenEvent(request_id=running.request_id, attempt=ATTEMPT, seq=running.made, token_offset=running.made,
                           token_ids=[], text="", finish_reason="length",
                           usage=TokenUsage(prompt_tokens=running.prompt_tokens, completion_tokens=running.made),
                           worker_id=WORKER_ID, emitted_at_us=time.time_ns() // 1000)
        await producer.send_and_wait(self._topic, self._finals.encode(final), key=running.request_id.encode(),
                                     partition=running.partition)


def main() -> None:
    import uvloop

    port, rate = int(sys.argv[1]), float(sys.argv[2])
    start_http_server(port, addr="127.0.0.1")
    uvloop.run(TokenSource(Settings(), rate).run())


if __name__ == "__main__":
    main()
