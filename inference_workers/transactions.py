"""One transactional producer per owned request partition: fencing for the partition's commits.

A request partition's commits (final token events, usage, the committed offset) go through a producer whose
transactional id belongs to the partition, not to the worker. Whoever owns the partition next starts a producer
with the same id, and Kafka then aborts the previous owner's open transaction and refuses every later commit of
the previous owner (``ProducerFenced``): a worker that lost a partition without knowing it (a long stall, a
network partition) can never move the partition's offset again, nor bill for it. (aiokafka's
``send_offsets_to_transaction`` carries no consumer-group generation, so this is the fencing available.)
"""

from __future__ import annotations

import asyncio
import logging

from aiokafka import AIOKafkaProducer, TopicPartition

from runtime.kafka_clients import make_producer
from runtime.settings import KafkaSettings

log = logging.getLogger(__name__)


def transactional_id(group: str, tp: TopicPartition) -> str:
    return f"{group}.txn.{tp.topic}.{tp.partition}"


class PartitionTransactions:
    def __init__(self, kafka: KafkaSettings, group: str) -> None:
        self._kafka = kafka
        self._group = group
        self._producers: dict[TopicPartition, AIOKafkaProducer] = {}

    def owned(self) -> set[TopicPartition]:
        return set(self._producers)

    def producer(self, tp: TopicPartition) -> AIOKafkaProducer | None:
        return self._producers.get(tp)

    async def acquire(self, tp: TopicPartition) -> None:
        """Start the partition's producer. NOTE: when this returns, the previous owner is fenced and its open
        transaction aborted, so the partition's committed state is final and can be read."""
        if tp in self._producers:
            return
        producer = make_producer(self._kafka, role=f"worker-txn-{tp.topic}-{tp.partition}",
                                 transactional_id=transactional_id(self._group, tp))
        await producer.start()
        self._producers[tp] = producer
        log.info("partition transactions acquired", extra={"partition": tp.partition})

    async def release(self, tp: TopicPartition) -> None:
        producer = self._producers.pop(tp, None)
        if producer is not None:
            try:
                await asyncio.wait_for(producer.stop(), 10)
            except Exception:  # a fenced producer may fail to stop cleanly (or at all); it is abandoned either way
                log.warning("partition producer did not stop cleanly", extra={"partition": tp.partition},
                            exc_info=True)

    async def close(self) -> None:
        for tp in list(self._producers):
            await self.release(tp)
