"""In-memory stand-ins for the worker's Kafka- and Redis-facing seams (``inference_workers/protocol.py``).

``ReplyLog`` is the token topic: what the sink emits and what the finalizer commits land in it in order, and
the prefix reader merges it with the real :class:`schemas.token_stream.TokenStream`, as the real one reads Kafka.
Commits go through the real :class:`inference_workers.offsets.OffsetTracker`. A transaction can be made to
"abort" after its final was written (as a worker killed between send and commit leaves it), to fail, or to be slow
(on its way until a flush waits for it); taking a partition's transactional id over can be made to fail or stall.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from aiokafka import TopicPartition
from aiokafka.structs import OffsetAndMetadata

from inference_workers.claims import Claim, ClaimVerdict
from inference_workers.emitter import Finished, PartitionLost
from inference_workers.offsets import CommittedState, OffsetTracker, decode_state
from inference_workers.resume import EmittedPrefix
from schemas.events import ChatRequest, TokenEvent, UsageEvent
from schemas.token_batch import Delta
from schemas.token_stream import TokenStream


@dataclass
class Sent:
    event: TokenEvent
    partition: int
    committed: bool = True  # False: written inside a transaction that aborted


class ReplyLog:
    """The token topic, all partitions, in log order."""

    def __init__(self) -> None:
        self.records: list[Sent] = []

    def events(self, request_id: str) -> list[TokenEvent]:
        return [s.event for s in self.records if s.event.request_id == request_id]

    def client_view(self, request_id: str) -> tuple[str, TokenStream]:
        """What the request's client receives: the relay's merge of everything in the log (read_uncommitted)."""
        stream, text = TokenStream(request_id), ""
        for event in self.events(request_id):
            accepted = stream.put(event)
            if accepted is not None:
                text += accepted.text
        return text, stream


class FakeSink:
    def __init__(self, log: ReplyLog) -> None:
        self.log = log
        #: token offsets whose delta the "broker" refuses
        self.refuse_at: set[int] = set()

    async def emit(self, event: TokenEvent | Delta, partition: int, traceparent: str | None
                   ) -> asyncio.Future[object]:
        # The real sink never suspends once it took the event (it only queues it): a cancel lands before, not after
        await asyncio.sleep(0)
        delivery: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        if event.token_offset in self.refuse_at:
            delivery.set_exception(ConnectionError("broker refused the delta"))
        else:
            # what a reader decodes from the record
            self.log.records.append(Sent(event.event() if isinstance(event, Delta) else event, partition))
            delivery.set_result(type("Meta", (), {"offset": len(self.log.records) - 1})())
        return delivery


class FakeClaims:
    """The claim script's rules (``inference_workers/claims.py``), in memory."""

    def __init__(self) -> None:
        self.claims: dict[str, dict[str, object]] = {}
        self.fail_with: Exception | None = None
        #: when set, claim() waits for it (a Redis round trip the test controls)
        self.hold: asyncio.Event | None = None
        self.calls = 0

    async def claim(self, request_id: str, source: str, attempt: int, *, org_id: str = "", key_id: str = ""
                    ) -> Claim:
        self.calls += 1
        if self.hold is not None:
            await self.hold.wait()
        if self.fail_with is not None:
            raise self.fail_with
        entry = self.claims.get(request_id)
        if entry is None or "src" not in entry:
            self.claims[request_id] = {**(entry or {}), "src": source, "attempt": attempt, "before": 0}
            return Claim(ClaimVerdict.START, 0)
        if entry["src"] != source:
            return Claim(ClaimVerdict.DUPLICATE)
        if entry.get("done"):
            return Claim(ClaimVerdict.DONE)
        current = int(entry["attempt"])  # type: ignore[call-overload]
        if current >= attempt:
            return Claim(ClaimVerdict.STALE, current)
        entry.update(attempt=attempt, before=current)
        return Claim(ClaimVerdict.START, current)

    def forget(self) -> None:
        """What a Redis restarted without persistence leaves: nothing."""
        self.claims.clear()

    async def record_first_offset(self, request_id: str, offset: int) -> None:
        self.claims.setdefault(request_id, {}).setdefault("first_offset", offset)

    async def first_offset(self, request_id: str) -> int | None:
        value = self.claims.get(request_id, {}).get("first_offset")
        return None if value is None else int(value)  # type: ignore[call-overload]

    async def mark_done(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.claims.setdefault(rid, {})["done"] = True


@dataclass
class FakeGroup:
    """What the workers of one group share: the reply log, the claims, the usage topic, the committed offsets and
    which worker's producer currently owns each partition's transactional id (the others are fenced)."""

    log: ReplyLog = field(default_factory=ReplyLog)
    claims: FakeClaims = field(default_factory=FakeClaims)
    usage: list[UsageEvent] = field(default_factory=list)
    committed: dict[TopicPartition, OffsetAndMetadata] = field(default_factory=dict)
    txn_owner: dict[TopicPartition, str] = field(default_factory=dict)
    #: the consumer group's generation: every rebalance makes a new one
    generation: int = 0

    def read_committed(self, partitions: set[TopicPartition]) -> dict[TopicPartition, CommittedState]:
        out = {}
        for tp in partitions:
            om = self.committed.get(tp)
            out[tp] = CommittedState(0, 0, frozenset()) if om is None else decode_state(om.offset, om.metadata)
        return out


_ownerships = itertools.count(1)


class FakeTransactions:
    """Per-partition transactional ids: acquiring one fences whoever held it. Each acquisition is an ownership of
    its own (the real one starts a new producer), which a commit queued under an earlier one must not commit in."""

    def __init__(self, group: FakeGroup, worker: str) -> None:
        self._group = group
        self._worker = worker
        self._owned: dict[TopicPartition, int] = {}
        #: raised by ``acquire`` (a takeover that fails: the transactional id refused, its coordinator unreachable)
        self.fail_with: Exception | None = None
        #: when set, ``acquire`` waits for it (the previous owner's transaction still ending, a coordinator moving)
        self.hold: asyncio.Event | None = None
        #: the partitions ``acquire`` was called for, in order (also those it stalled or failed on)
        self.acquiring: list[TopicPartition] = []

    def owned(self) -> set[TopicPartition]:
        return set(self._owned)

    def ownership(self, tp: TopicPartition) -> int | None:
        """The current ownership of ``tp`` (None: not owned)."""
        return self._owned.get(tp)

    def fenced(self, tp: TopicPartition) -> bool:
        return self._group.txn_owner.get(tp) != self._worker

    async def acquire(self, tp: TopicPartition) -> None:
        self.acquiring.append(tp)
        if self.hold is not None:
            await self.hold.wait()
        if self.fail_with is not None:
            raise self.fail_with
        self._group.txn_owner[tp] = self._worker
        self._owned[tp] = next(_ownerships)

    async def release(self, tp: TopicPartition) -> None:
        self._owned.pop(tp, None)


@dataclass
class FakeFinalizer:
    """Commits at once, through the real offset tracker, into the group's log, usage and committed offsets.

    With ``slow``, as ``emitter.Finalizer`` commits: apart from the caller (a cancelled job does not cancel its
    commit), each commit on its way (``pending``) until a flush waits for it (a flush's bounded wait outlasts a
    commit) or the test lets it land (``land``), and then only under the partition ownership it was queued in."""

    group: FakeGroup
    offsets: OffsetTracker
    transactions: FakeTransactions
    #: abort (after writing the final) the next transaction: a worker killed between send and commit
    abort_next: bool = False
    #: raised by the next transaction instead of committing (PartitionLost: fenced; FatalError: a producer left
    #: unusable), after which commits succeed again
    fail_next: BaseException | None = None
    slow: bool = False
    finished: list[Finished] = field(default_factory=list)
    #: slow commits on their way: finished requests not committed yet
    pending: list[Finished] = field(default_factory=list)
    #: flushes that found commits on their way
    flushes_with_work: int = 0
    _landings: list[asyncio.Future[None]] = field(default_factory=list, init=False, repr=False)
    _commits: set[asyncio.Task[None]] = field(default_factory=set, init=False, repr=False)

    async def finish(self, item: Finished) -> None:
        if not self.slow:
            return await self._transaction(item)
        commit = asyncio.ensure_future(self._commit_when_landed(item, self.transactions.ownership(item.source)))
        self._commits.add(commit)
        commit.add_done_callback(self._forget)
        await asyncio.shield(commit)

    def _forget(self, commit: asyncio.Task[None]) -> None:
        self._commits.discard(commit)
        if not commit.cancelled():
            commit.exception()  # its caller may be gone (a job aborted meanwhile): retrieved here

    async def _commit_when_landed(self, item: Finished, ownership: int | None) -> None:
        landing: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._landings.append(landing)
        self.pending.append(item)
        try:
            await landing
            if ownership is None or self.transactions.ownership(item.source) != ownership:
                raise PartitionLost(f"partition {item.source.partition} is no longer this worker's")
            await self._transaction(item)
        finally:
            self.pending.remove(item)

    def land(self) -> None:
        """Let every commit on its way land now."""
        landings, self._landings = self._landings, []
        for landing in landings:
            if not landing.done():
                landing.set_result(None)

    async def _transaction(self, item: Finished) -> None:
        await asyncio.sleep(0)
        if self.transactions.fenced(item.source):
            raise PartitionLost("fenced")
        if self.fail_next is not None:
            failure, self.fail_next = self.fail_next, None
            raise failure
        if self.abort_next:
            self.abort_next = False
            self.group.log.records.append(Sent(item.final, item.reply_partition, committed=False))
            raise asyncio.CancelledError  # the worker "died" here: nothing after this happens
        self.group.log.records.append(Sent(item.final, item.reply_partition))
        if item.usage is not None:
            self.group.usage.append(item.usage)
        self.finished.append(item)
        self.offsets.done(item.source, item.offset)
        self._commit(item.source)
        await self.group.claims.mark_done([item.final.request_id])

    def commit_offsets_soon(self, tp: TopicPartition) -> None:
        if not self.transactions.fenced(tp):
            self._commit(tp)

    def _commit(self, tp: TopicPartition) -> None:
        offsets = self.offsets.committable([tp])
        if offsets:
            self.offsets.committed(offsets)
            self.group.committed.update(offsets)

    async def flush(self, timeout_s: float | None = None) -> None:
        """Return once everything queued so far is committed or has failed, or after ``timeout_s``."""
        if not self._commits:
            await asyncio.sleep(0)
            return
        self.flushes_with_work += 1
        commits = set(self._commits)
        self.land()
        await asyncio.wait(commits, timeout=timeout_s)


class FakePrefixReader:
    def __init__(self, log: ReplyLog) -> None:
        self.log = log
        self.reads = 0

    async def read(self, request: ChatRequest, first_offset: int | None) -> EmittedPrefix:
        self.reads += 1
        await asyncio.sleep(0)
        text, stream = self.log.client_view(request.request_id)
        return EmittedPrefix(list(stream.token_ids), text, stream.attempt, stream.final, stream.error)


class _Healthy:
    """aiokafka's transaction manager, as a producer neither fenced nor broken shows it."""

    @staticmethod
    def is_fatal_error() -> bool:
        return False


class TxnProducerStub:
    """Just enough of a transactional AIOKafkaProducer for the Finalizer: each record is acknowledged at once
    (``delivery``), the transaction commits, offsets and flush do nothing. Tests override what they stage."""

    def __init__(self) -> None:
        self._txn_manager: object = _Healthy()

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[None]:
        yield

    async def send(self, topic: str, value: bytes, key: bytes, partition: int | None = None,
                   headers: object = None) -> asyncio.Future[None]:
        return self.delivery()

    def delivery(self) -> asyncio.Future[None]:
        """The record's ack, as aiokafka's ``send`` returns it: here at once."""
        acked: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        acked.set_result(None)
        return acked

    async def send_offsets_to_transaction(self, offsets: object, group_id: str) -> None:
        return None

    async def flush(self) -> None:
        return None


class OneProducer:
    """PartitionTransactions with one producer for every partition; ``current`` may be swapped (a partition lost
    and regained: a new producer)."""

    def __init__(self, producer: TxnProducerStub) -> None:
        self.current = producer

    def producer(self, tp: TopicPartition) -> TxnProducerStub:
        return self.current
