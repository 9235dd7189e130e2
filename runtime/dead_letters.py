"""The dead-letter topic: a record no service can read goes there as it came, with why and where from.

One header layout for every producer of dead letters (the worker, the gateway's relay, the Faust processors),
so an operator reads them all the same way. Dead-lettering never stops a service: a failure to dead-letter is
logged and counted, and the service goes on.
"""

from __future__ import annotations

import logging

from aiokafka import AIOKafkaProducer, ConsumerRecord
from aiokafka.errors import KafkaError

from runtime.metrics import DEAD_LETTERED
from runtime.settings import KafkaSettings
from schemas.topics import TOPICS

log = logging.getLogger(__name__)

Headers = list[tuple[str, bytes]]


def dead_letter_headers(reason: str, *, topic: str, partition: int, offset: int, processor: str) -> Headers:
    return [
        ("reason", reason.encode()),
        ("source-topic", topic.encode()),
        ("source-partition", str(partition).encode()),
        ("source-offset", str(offset).encode()),
        ("processor", processor.encode()),
    ]


class DeadLetters:
    """Dead-letters raw records through one of the service's (idempotent) producers."""

    def __init__(self, producer: AIOKafkaProducer, kafka: KafkaSettings, processor: str) -> None:
        self._producer = producer
        self._topic = kafka.topic(TOPICS.dead_letter.name)
        self._processor = processor

    async def send(self, record: ConsumerRecord[bytes, bytes], reason: str) -> None:
        DEAD_LETTERED.labels(processor=self._processor, topic=record.topic).inc()
        log.warning("record dead-lettered", extra={"topic": record.topic, "partition": record.partition,
                                                   "offset": record.offset, "reason": reason})
        headers = [*(record.headers or ()), *dead_letter_headers(
            reason, topic=record.topic, partition=record.partition, offset=record.offset,
            processor=self._processor)]
        try:
            await self._producer.send_and_wait(self._topic, value=record.value, key=record.key, headers=headers)
        except KafkaError:
            log.exception("could not dead-letter a record", extra={"topic": record.topic, "offset": record.offset})
