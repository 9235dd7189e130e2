"""The worker's composition root: builds the clients and components once and runs their loops.

Loops: the request consumer (group member with the sticky load-aware assignor, read_committed, partitions paused
when the engine is full), the control listener, the finalizer's commit loop, the gateway-presence check and the
admin server. The worker stops on SIGTERM (drain, then abort what remains: the partitions' next owner takes it
over), and exits non-zero when the engine dies or commits keep failing.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import AsyncExitStack
from functools import partial
from typing import Any

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition
from aiokafka import errors as Errors
from aiokafka.errors import KafkaError
from aiokafka.protocol.group import HeartbeatRequest

from inference_workers.admin import admin_server, create_admin_app
from inference_workers.assignor import StickyLoadAssignor
from inference_workers.claims import RequestClaims
from inference_workers.control import ControlListener
from inference_workers.emitter import Finalizer
from inference_workers.intake import Intake
from inference_workers.liveness import WorkerLiveness
from inference_workers.offsets import CommittedState, OffsetTracker, decode_state
from inference_workers.prefix import PrefixReader
from inference_workers.presence import GatewayPresence
from inference_workers.priority import PriorityGate
from inference_workers.protocol import EngineClient
from inference_workers.rebalance import Membership, RequestRebalanceListener
from inference_workers.token_sink import TokenSink
from inference_workers.transactions import PartitionTransactions
from runtime.dead_letters import DeadLetters
from runtime.faults import Faults
from runtime.kafka_clients import committed_with_metadata, consume, make_consumer, make_producer, stop_consumer
from runtime.limiter import RateLimiter
from runtime.redis_client import make_redis
from runtime.settings import Settings
from schemas.codec import codec_for
from schemas.events import ChatRequest
from schemas.topics import PRIORITIES, TOPICS

log = logging.getLogger(__name__)

#: /health turns red when no commit has succeeded for this long while commits are pending
STALLED_COMMITS_S = 10.0


async def committed_states(consumer: AIOKafkaConsumer, partitions: set[TopicPartition]
                           ) -> dict[TopicPartition, CommittedState]:
    """Each partition's committed offset and state; a partition never committed starts at its beginning."""
    found = await committed_with_metadata(consumer, partitions)
    never = [tp for tp, om in found.items() if om is None]
    beginnings = await consumer.beginning_offsets(never) if never else {}
    return {tp: (decode_state(om.offset, om.metadata) if om is not None
                 else CommittedState(beginnings[tp], beginnings[tp], frozenset())) for tp, om in found.items()}


def group_generation(consumer: AIOKafkaConsumer) -> int:
    """The consumer's current group generation (-1 once the coordinator expelled it). aiokafka keeps it on its
    coordinator and exposes no public accessor."""
    return int(consumer._coordinator.generation)


#: FENCED_INSTANCE_ID (a static member replaced), which aiokafka 0.14 does not name
_FENCED_INSTANCE_ID = 82
#: a heartbeat's answers that say this consumer is not (or no longer) a member of the generation it named
_NOT_A_MEMBER = frozenset([*(e.errno for e in (Errors.UnknownMemberIdError, Errors.IllegalGenerationError,
                                                Errors.RebalanceInProgressError)), _FENCED_INSTANCE_ID])


async def still_member(consumer: AIOKafkaConsumer, timeout_s: float, generation: int) -> Membership:
    """What the group coordinator says of this consumer in ``generation``: a heartbeat of our own (beside the
    consumer's: requests on one connection are matched by correlation id)."""
    coordinator = consumer._coordinator
    request = HeartbeatRequest(coordinator.group_id, generation, coordinator.member_id)
    try:
        response = await asyncio.wait_for(coordinator._send_req(request), timeout_s)
    except (KafkaError, TimeoutError):
        return Membership.UNKNOWN
    if response.error_code == 0:
        return Membership.MEMBER
    return Membership.NOT_MEMBER if response.error_code in _NOT_A_MEMBER else Membership.UNKNOWN


def rejoin_without(consumer: AIOKafkaConsumer, assignor: StickyLoadAssignor, partitions: set[TopicPartition]
                   ) -> None:
    """Rejoin the group (at once, not at the next heartbeat) claiming ``partitions`` no more."""
    assignor.disown(partitions)
    consumer._coordinator.request_rejoin()


class Worker:
    def __init__(self, settings: Settings, engine: EngineClient) -> None:
        self.settings = settings
        self.engine = engine
        self.stop_requested = asyncio.Event()
        self._consumer_task: asyncio.Task[None] | None = None
        self._intake: Intake | None = None
        self._listener: RequestRebalanceListener | None = None
        self._control: ControlListener | None = None
        self._finalizer: Finalizer | None = None

    def problems(self) -> list[str]:
        """Why this worker cannot serve right now (empty: healthy)."""
        found = []
        if not self.engine.healthy:
            found.append("the engine is not healthy")
        if self._consumer_task is None or self._consumer_task.done():
            found.append("the request consumer is not running")
        if self._control is None or not self._control.healthy:
            found.append("the control listener is not running")
        if self._finalizer is not None and self._finalizer.stalled_for() > STALLED_COMMITS_S:
            found.append(f"no commit succeeded for {self._finalizer.stalled_for():.0f} s")
        if self._intake is not None and self._intake.degraded:
            found.append(self._intake.degraded)
        return found

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
        token_topic = kafka.topic(TOPICS.tokens.name)
        async with AsyncExitStack() as stack:
            redis = make_redis(s.redis)
            stack.push_async_callback(redis.aclose)
            claims = RequestClaims(redis, s.redis, worker_id=worker.instance_id, ttl_s=worker.request_claim_ttl_s)

            delta_producer = make_producer(kafka, role="worker-tokens")
            await delta_producer.start()
            stack.push_async_callback(delta_producer.stop)
            dead_letters = DeadLetters(delta_producer, kafka, "worker")
            transactions = PartitionTransactions(kafka, worker.group)
            stack.push_async_callback(transactions.close)
            prefix = PrefixReader(kafka, token_topic)
            await prefix.start()
            stack.push_async_callback(prefix.stop)

            offsets = OffsetTracker()
            finalizer = Finalizer(
                transactions, token_topic=token_topic, usage_topic=kafka.topic(TOPICS.usage.name), group_id=group,
                stored_topic=kafka.topic(TOPICS.stored_completions.name),
                offsets=offsets, claims=claims, batch_max=worker.finalize_batch_max,
                give_up_s=worker.finalize_give_up_s, faults=Faults(s.faults),
                settlements=RateLimiter(redis, s.redis), token_version=worker.token_record_version,
            )
            self._finalizer = finalizer
            commit_loop = asyncio.create_task(finalizer.run(), name="finalizer")
            queues = {kafka.topic(TOPICS.admitted(p).name): p for p in PRIORITIES}
            ranks = {p: rank for rank, p in enumerate(PRIORITIES)}
            sink = TokenSink(delta_producer, token_topic, version=worker.token_record_version,
                             max_events=worker.token_record_max_events)
            stack.push_async_callback(sink.close)
            intake = Intake(engine=self.engine, worker_id=worker.instance_id, claims=claims,
                            sink=sink, finalizer=finalizer, offsets=offsets,
                            prefix=prefix, max_in_flight=self.engine.max_num_seqs, dead_letters=dead_letters,
                            retry_delay_s=worker.admission_retry_s, give_up_s=worker.finalize_give_up_s,
                            priority_of=lambda tp: ranks.get(queues.get(tp.topic, ""), 0))
            self._intake = intake

            control = ControlListener(kafka, kafka.topic(TOPICS.control.name), worker.control_lookback_s,
                                      intake.on_control, dead_letters)
            await control.start()
            stack.push_async_callback(control.stop)
            self._control = control
            presence = GatewayPresence(redis, s.redis, intake, check_every_s=worker.presence_check_s,
                                       grace_s=worker.unattended_grace_s)
            presence_loop = asyncio.create_task(presence.run(), name="gateway-presence")

            assignor = StickyLoadAssignor(offsets.open_counts)
            consumer = make_consumer(kafka, role="worker", group=worker.group,
                                     instance_id=worker.instance_id if worker.static_membership else None,
                                     assignors=[assignor])
            listener = RequestRebalanceListener(intake, finalizer, offsets, transactions,
                                                partial(committed_states, consumer), consumer.seek,
                                                partial(group_generation, consumer), on_expelled=assignor.forget,
                                                rejoin_without=partial(rejoin_without, consumer, assignor),
                                                # inside the connection's own request timeout, which would
                                                # close the coordinator connection under a join in flight
                                                still_member=partial(still_member, consumer,
                                                                     kafka.request_timeout_ms / 2000),
                                                membership_check_s=kafka.heartbeat_interval_ms / 1000)
            finalizer.set_partition_lost(listener.partition_lost)
            self._listener = listener
            consumer.subscribe(list(queues), listener=listener)
            await consumer.start()
            gate = PriorityGate(consumer, queues, ranks, min_share=worker.priority_min_share,
                                refresh_s=worker.priority_refresh_s)

            depth_loop = asyncio.create_task(gate.report_depth(engine_full=lambda: intake.capacity() <= 0),
                                             name="queue-depth")
            liveness = WorkerLiveness(redis, s.redis, consumer, group=group, instance_id=worker.instance_id,
                                      ttl_s=worker.liveness_ttl_s, renew_s=worker.liveness_renew_s)
            liveness_loop = (asyncio.create_task(liveness.run(), name="worker-liveness") if worker.liveness_ttl_s
                             else None)

            async def handle(request: ChatRequest, record: ConsumerRecord[bytes, bytes]) -> None:
                await intake.handle(request, record)
                if request.request_id in intake.jobs:  # started (a skipped duplicate is no admission)
                    gate.admitted(TopicPartition(record.topic, record.partition))

            admin = admin_server(create_admin_app(self.problems, self.state), worker.admin_host, worker.admin_port)
            admin_task = asyncio.create_task(admin.serve(), name="admin")
            consumer_stop = asyncio.Event()
            self._consumer_task = asyncio.create_task(
                consume(consumer, codec_for(ChatRequest), handle, stop=consumer_stop,
                        capacity=intake.capacity, room_freed=intake.room_freed, accepts=intake.accepts,
                        undecodable=intake.undecodable, select=gate.select if worker.priority_classes else None),
                name="request-consumer",
            )
            log.info("worker ready", extra={"group": group, "max_in_flight": self.engine.max_num_seqs})
            try:
                await self._until_stop_or_failure(intake, commit_loop)
            finally:
                # 1. Stop taking requests. 2. Let running ones finish (bounded). 3. Commit. 4. Leave.
                consumer_stop.set()
                listener.stop()
                await asyncio.gather(self._consumer_task, return_exceptions=True)
                presence_loop.cancel()
                depth_loop.cancel()
                if not intake.fatal.done():
                    await intake.drain(worker.drain_timeout_s)
                if not commit_loop.done():
                    await finalizer.stop()
                await stop_consumer(consumer)
                if liveness_loop is not None:
                    # Renewed until the consumer left: a draining worker still owns its partitions.
                    liveness_loop.cancel()
                    await liveness.close()
                admin.should_exit = True
                await asyncio.gather(admin_task, presence_loop, depth_loop, return_exceptions=True)

    async def _until_stop_or_failure(self, intake: Intake, commit_loop: asyncio.Task[None]) -> None:
        assert self._consumer_task is not None
        stop = asyncio.ensure_future(self.stop_requested.wait())
        watched: set[asyncio.Future[Any]] = {stop, self._consumer_task, commit_loop, intake.fatal}
        done, _ = await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        for future in done:
            error = None if future is stop else future.exception()
            if error is not None:
                # Logged now: stopping with Kafka away can fail too, and its error would be the one reported.
                log.error("worker failed; stopping", exc_info=error)
                raise error
