"""A worker made of the real intake, offsets and rebalance listener over the fakes: what unit tests drive."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

from aiokafka import ConsumerRecord, TopicPartition

from inference_workers.intake import Intake
from inference_workers.offsets import OffsetTracker
from inference_workers.rebalance import RequestRebalanceListener
from schemas.events import ChatMessage, ChatRequest, ReplyTo, SamplingSpec, utcnow
from tests.fakes.engine import FakeEngine
from tests.fakes.kafka import FakeFinalizer, FakeGroup, FakePrefixReader, FakeSink, FakeTransactions

TOPIC = "requests"
_ids = itertools.count()


def request(max_tokens: int = 6, *, temperature: float = 0.0, seed: int | None = None, reply: int = 3,
            gateway: str = "gw/1", deadline_in_s: float | None = 60.0, prompt: list[int] | None = None,
            **sampling: object) -> ChatRequest:
    now = utcnow()
    return ChatRequest(
        request_id=f"chatcmpl-{next(_ids)}", created_at=now, org_id="org", key_id="key", tier="pro", model="m",
        messages=[ChatMessage(role="user", content="hi")], prompt_token_ids=prompt or [1, 2, 3, 4],
        sampling=SamplingSpec(max_tokens=max_tokens, temperature=temperature, seed=seed, **sampling),  # type: ignore[arg-type]
        stream=True, reply=ReplyTo(partition=reply, gateway_id=gateway),
        deadline_at=None if deadline_in_s is None else now + timedelta(seconds=deadline_in_s),
    )


def record(partition: int, offset: int, value: bytes = b"", headers: list[tuple[str, bytes]] | None = None
           ) -> ConsumerRecord[bytes, bytes]:
    return ConsumerRecord(topic=TOPIC, partition=partition, offset=offset, timestamp=0, timestamp_type=0,
                          key=None, value=value, checksum=None, serialized_key_size=0,
                          serialized_value_size=len(value), headers=headers or [])


@dataclass
class FakeWorker:
    name: str
    group: FakeGroup
    engine: FakeEngine = field(default_factory=FakeEngine)

    def __post_init__(self) -> None:
        self.offsets = OffsetTracker()
        self.transactions = FakeTransactions(self.group, self.name)
        self.finalizer = FakeFinalizer(self.group, self.offsets, self.transactions)
        self.prefix = FakePrefixReader(self.group.log)
        self.intake = Intake(engine=self.engine, worker_id=self.name, claims=self.group.claims,
                             sink=FakeSink(self.group.log), finalizer=self.finalizer, offsets=self.offsets,
                             prefix=self.prefix, max_in_flight=self.engine.max_num_seqs, retry_delay_s=0.01,
                             give_up_s=0.2)
        self.seeks: list[tuple[TopicPartition, int]] = []
        #: the generation this worker's consumer is in (-1: expelled); None before it joined
        self.generation: int | None = None
        #: the partitions of each rejoin the listener asked for (``rejoin_without``)
        self.rejoins: list[set[TopicPartition]] = []

        async def read_committed(partitions: set[TopicPartition]):  # type: ignore[no-untyped-def]
            return self.group.read_committed(partitions)

        self.listener = RequestRebalanceListener(self.intake, self.finalizer, self.offsets, self.transactions,
                                                 read_committed, lambda tp, offset: self.seeks.append((tp, offset)),
                                                 lambda: -1 if self.generation is None else self.generation,
                                                 rejoin_without=self.rejoins.append, membership_check_s=0,
                                                 flush_timeout_s=0.1)

    async def assign(self, *partitions: int) -> None:
        """A whole eager rebalance, as this worker sees it: revoke everything owned, then assign ``partitions``
        in a new generation. A worker that missed a rebalance meanwhile (its generation is behind the group's)
        was expelled: its revoke sees generation -1, as aiokafka's does."""
        await self.revoke()
        await self.assigned(*partitions)

    async def revoke(self) -> None:
        """The first half of an eager rebalance: everything owned is revoked (then the worker rejoins, which takes
        a while: other workers may be assigned meanwhile)."""
        if self.generation is not None and self.generation < self.group.generation:
            self.generation = -1
        await self.listener.on_partitions_revoked(self.transactions.owned())

    async def assigned(self, *partitions: int) -> None:
        """The second half: the rebalance's assignment, in a new generation."""
        self.group.generation += 1
        self.generation = self.group.generation
        await self.listener.on_partitions_assigned({TopicPartition(TOPIC, p) for p in partitions})

    async def handle(self, req: ChatRequest, partition: int, offset: int) -> None:
        await self.intake.handle(req, record(partition, offset))

    async def settle(self) -> None:
        """Wait until every job of this worker has ended."""
        import asyncio

        while self.intake.jobs:
            await asyncio.gather(*(j.task for j in list(self.intake.jobs.values()) if j.task), return_exceptions=True)


_created: list[FakeWorker] = []


def make(name: str, group: FakeGroup, engine: FakeEngine | None = None) -> FakeWorker:
    """A FakeWorker that ``stop_made_workers`` cleans up after the test (its leftover generations would otherwise
    leak into the session-scoped event loop of the following tests)."""
    worker = FakeWorker(name, group, engine) if engine is not None else FakeWorker(name, group)
    _created.append(worker)
    return worker


async def stop_made_workers() -> None:
    tasks = [j.task for w in _created for j in list(w.intake.jobs.values()) if j.task is not None]
    tasks += [t for w in _created for t in list(w.intake._background)]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    _created.clear()


async def pump(n: int = 30) -> None:
    """Let the event loop run ``n`` turns: enough for queued callbacks and sends to settle."""
    for _ in range(n):
        await asyncio.sleep(0)


async def until(condition: Callable[[], object], turns: int = 1000) -> None:
    """Run the event loop until ``condition`` holds: within ``turns`` turns (nothing the fakes do waits on a clock),
    else fail."""
    for _ in range(turns):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"the condition did not hold within {turns} turns of the event loop")
