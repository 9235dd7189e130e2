"""The worker's composition root: builds the clients and components once and runs their loops.

Loops: the request consumer (group member, read_committed, partitions paused when the engine is full), the
control listener, the finalizer's commit loop and the admin server. The worker stops on SIGTERM (drain,
then abort what remains: Kafka redelivers it), and exits non-zero when the engine dies or it is fenced.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import AsyncExitStack
from typing import Any

from inference_workers.admin import admin_server, create_admin_app
from inference_workers.claims import RequestClaims
from inference_workers.control import ControlListener
from inference_workers.emitter import Finalizer, TokenSink
from inference_workers.intake import Intake
from inference_workers.offsets import OffsetTracker
from inference_workers.protocol import EngineClient
from inference_workers.rebalance import RequestRebalanceListener
from runtime.kafka_clients import consume, make_consumer, make_producer
from runtime.redis_client import make_redis
from runtime.settings import Settings
from schemas.codec import codec_for
from schemas.events import ChatRequest
from schemas.topics import TOPICS

log = logging.getLogger(__name__)


class Worker:
    def __init__(self, settings: Settings, engine: EngineClient) -> None:
        self.settings = settings
        self.engine = engine
        self.stop_requested = asyncio.Event()
        self._consumer_task: asyncio.Task[None] | None = None
        self._intake: Intake | None = None
        self._listener: RequestRebalanceListener | None = None
        self._control: ControlListener | None = None

    def healthy(self) -> bool:
        return (
            self.engine.healthy
            and self._consumer_task is not None
            and not self._consumer_task.done()
            and self._control is not None
            and self._control.healthy
        )

    def state(self) -> dict[str, Any]:
        return {
            "instance": self.settings.worker.instance_id,
            "engine": self.engine.describe(),
            "capacity": self._intake.capacity() if self._intake else 0,
            "assigned": sorted(tp.partition for tp in self._listener.assigned) if self._listener else [],
            "in_flight": self._intake.state() if self._intake else [],
        }

    async def run(self) -> None:
        s = self.settings
        kafka, worker = s.kafka, s.worker
        group = kafka.group(worker.group)
        async with AsyncExitStack() as stack:
            redis = make_redis(s.redis)
            stack.push_async_callback(redis.aclose)
            claims = RequestClaims(redis, s.redis, worker_id=worker.instance_id, ttl_s=worker.request_claim_ttl_s)

            delta_producer = make_producer(kafka, role="worker-tokens")
            await delta_producer.start()
            stack.push_async_callback(delta_producer.stop)
            txn_producer = make_producer(kafka, role="worker-txn", transactional_id=worker.instance_id)
            await txn_producer.start()
            stack.push_async_callback(txn_producer.stop)

            offsets = OffsetTracker()
            finalizer = Finalizer(
                txn_producer, token_topic=kafka.topic(TOPICS.tokens.name), usage_topic=kafka.topic(TOPICS.usage.name),
                group_id=group, offsets=offsets, claims=claims, batch_max=worker.finalize_batch_max,
            )
            commit_loop = asyncio.create_task(finalizer.run(), name="finalizer")
            intake = Intake(engine=self.engine, worker_id=worker.instance_id, claims=claims,
                            sink=TokenSink(delta_producer, kafka.topic(TOPICS.tokens.name)), finalizer=finalizer,
                            offsets=offsets, max_in_flight=self.engine.max_num_seqs)
            self._intake = intake

            control = ControlListener(kafka, kafka.topic(TOPICS.control.name), worker.control_lookback_s,
                                      intake.on_control)
            await control.start()
            stack.push_async_callback(control.stop)
            self._control = control

            consumer = make_consumer(kafka, role="worker", group=worker.group,
                                     instance_id=worker.instance_id if worker.static_membership else None)
            listener = RequestRebalanceListener(intake, finalizer, offsets)
            self._listener = listener
            consumer.subscribe([kafka.topic(TOPICS.requests_admitted.name)], listener=listener)
            await consumer.start()

            admin = admin_server(create_admin_app(self.healthy, self.state), worker.admin_host, worker.admin_port)
            admin_task = asyncio.create_task(admin.serve(), name="admin")
            consumer_stop = asyncio.Event()
            self._consumer_task = asyncio.create_task(
                consume(consumer, codec_for(ChatRequest), intake.handle, stop=consumer_stop,
                        capacity=intake.capacity, room_freed=intake.room_freed),
                name="request-consumer",
            )
            log.info("worker ready", extra={"group": group, "max_in_flight": self.engine.max_num_seqs})
            try:
                await self._until_stop_or_failure(intake, commit_loop)
            finally:
                # 1. Stop taking requests. 2. Let running ones finish (bounded). 3. Commit. 4. Leave.
                consumer_stop.set()
                await asyncio.gather(self._consumer_task, return_exceptions=True)
                if not intake.fatal.done():
                    await intake.drain(worker.drain_timeout_s)
                if not commit_loop.done():
                    await finalizer.stop()
                await consumer.stop()
                admin.should_exit = True
                await asyncio.gather(admin_task, return_exceptions=True)

    async def _until_stop_or_failure(self, intake: Intake, commit_loop: asyncio.Task[None]) -> None:
        assert self._consumer_task is not None
        stop = asyncio.ensure_future(self.stop_requested.wait())
        watched: set[asyncio.Future[Any]] = {stop, self._consumer_task, commit_loop, intake.fatal}
        done, _ = await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        for future in done:
            if future is not stop and future.exception() is not None:
                raise future.exception()  # type: ignore[misc]
