"""Admission and generation: from a request record to token events and a finished request.

The consumer loop (``runtime.kafka_clients.consume``) asks :meth:`Intake.capacity` before each fetch, so the
worker never holds more requests than the engine batches, and :meth:`Intake.accepts` before each record, so
nothing is admitted from a partition while a rebalance settles it. Admission and the rebalance listener take
:attr:`Intake.admission` in turn: a revocation never interleaves with a record being admitted.

Each admitted request runs in its own task around ``engine.generate()``. A request some earlier attempt
started (its claim says so, or the previous owner's commit listed it as open) is taken over: the task first
reads what it emitted (``prefix.py``) and continues from there (``resume.py``). A task ends in one of three ways:

* finished by the engine (stop, length, error): its final event and usage are committed by the Finalizer;
* aborted by a cancel, a halt, an unattended stream (no client connection attached for its resume window,
  ``listeners.py``) or a lost delta: same, with what was emitted so far;
* aborted because its partition moved or the worker is stopping: nothing is committed, the partition's next
  owner takes it over.

A request whose queue deadline passed before it started is not generated and not billed: its client gets
``queue_deadline_exceeded``.

While no client connection is attached to a stream (its client dropped and has not resumed yet, or its gateway
died), its generation is *suspended*: the engine forgets it (what it had produced but not emitted is dropped) and
the job waits, out of the engine's batch, for a client to come back within the window; then it continues from what
it emitted, one prefill (``resume.py``, as a takeover does). Nothing is generated for nobody but what was in flight
when the worker learned of the drop, and everything a generation emitted is in the log, for any client of the
stream to read: it is what a stopped generation is billed (``listeners.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Callable, Coroutine, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from functools import partial

from aiokafka import ConsumerRecord, TopicPartition
from aiokafka.errors import KafkaError
from redis.exceptions import RedisError

from inference_workers.claims import ClaimVerdict
from inference_workers.control import RecentControls
from inference_workers.emitter import Delivery, Finished, PartitionLost
from inference_workers.head_start import HeadStart
from inference_workers.listeners import Listeners
from inference_workers.offsets import OffsetTracker, Taken
from inference_workers.protocol import (
    ClaimsT,
    EngineClient,
    EngineDeadError,
    EngineDelta,
    FinalizerT,
    PrefixReaderT,
    TokenSinkT,
)
from inference_workers.resume import NOTHING_EMITTED, Diverged, EmittedPrefix, ReplayFilter, plan
from runtime.dead_letters import DeadLetters
from runtime.logs import request_scope
from runtime.metrics import (
    KAFKA_HOP,
    WORKER_ABORTED,
    WORKER_CLAIM,
    WORKER_CONSUMED,
    WORKER_DEFERRED,
    WORKER_FINISHED,
    WORKER_IN_FLIGHT,
    WORKER_REPLAYED_TOKENS,
    WORKER_SKIPPED,
    WORKER_SUSPENDED,
    WORKER_TAKEOVERS,
    WORKER_TOKENS_OUT,
    WORKER_TTFT,
    WORKER_UNATTENDED_TOKENS,
)
from runtime.tracing import child_of, from_headers
from schemas.errors import DecodeError, FatalError, RetryLater
from schemas.events import (
    ChatRequest,
    ControlAction,
    ControlEvent,
    ErrorCode,
    StoredCompletion,
    TokenEvent,
    TokenUsage,
    UsageEvent,
    utcnow,
)
from schemas.headers import reply_address
from schemas.token_batch import Delta

log = logging.getLogger(__name__)
#: what a client is told of a generation the engine failed (the cause is in the worker's log, by request id)
ENGINE_FAILED = "the engine could not generate this request; the worker's log has the cause"

#: why a generation was interrupted → the finish reason it is committed with (None: not committed at all)
ABORT_OUTCOMES: dict[str, str | None] = {
    "cancel": "cancelled",
    "halt": "content_filter",
    "unattended": "cancelled",
    "delivery": "error",
    "revoked": None,
    "shutdown": None,
}
#: Redis and socket failures while claiming: the record waits, nothing is skipped
CLAIM_ERRORS = (RedisError, OSError, TimeoutError)


def _now_us() -> int:
    return time.time_ns() // 1000


@dataclass
class Job:
    request: ChatRequest
    source: TopicPartition
    offset: int
    attempt: int
    traceparent: str | None
    admitted_at: float
    started_at: datetime
    #: an earlier attempt may have emitted tokens: read them and continue
    takeover: bool = False
    task: asyncio.Task[None] | None = None
    #: completion tokens the client has (or will have) so far, earlier attempts included
    tokens: int = 0
    abort_cause: str | None = None
    #: completion tokens before the first delta the broker did not take (a lost delta ends the stream there)
    undelivered_from: int | None = None
    prefix: EmittedPrefix = NOTHING_EMITTED
    #: the prompt was processed (by this attempt's engine, or an earlier attempt's): it is billed
    ran: bool = False
    #: the next event's seq in this attempt, and the broker's acks still awaited
    seq: int = 0
    last_delivery: Delivery | None = None
    in_flight: set[Delivery] = field(default_factory=set)
    #: the client connections of its stream, from the control topic and the presence check
    listeners: Listeners = field(default_factory=lambda: Listeners.of(""))
    #: every token emitted so far (earlier attempts' included) and its text: where a suspended generation continues
    emitted_ids: list[int] = field(default_factory=list)
    emitted_text: list[str] = field(default_factory=list)
    #: set while the generation is suspended (no client attached); set again when one is
    attended: asyncio.Event | None = None
    #: out of the engine's batch: suspended, or back but waiting for room in the batch
    parked: bool = False
    #: time spent suspended (left out of its time to first token)
    suspended_s: float = 0.0
    #: stopped by a cancel, a halt or its window: billed by its connections once what was emitted is known
    #: (``Listeners.received_cap``, at the commit: a takeover stopped while it reads the log back knows it then)
    billed_by_connections: bool = False
    #: generation is over and its outcome being committed: aborting it now would only lose the commit
    finalizing: bool = False
    #: the completion's text so far, earlier attempts' included (kept only when it is stored or a turn recorded)
    text_parts: list[str] = field(default_factory=list)
    #: the engine was given the request before its claim came back (``head_start.py``); read by ``_stream``
    head: HeadStart | None = None

    def describe(self) -> dict[str, object]:
        return {"request_id": self.request.request_id, "attempt": self.attempt, "tokens": self.tokens,
                "max_tokens": self.request.sampling.max_tokens, "partition": self.source.partition,
                "offset": self.offset, "aborting": self.abort_cause, "takeover": self.takeover,
                "gateway": self.request.reply.gateway_id, "attended": self.listeners.live,
                "suspended": self.suspended}

    @property
    def suspended(self) -> bool:
        return self.parked


@dataclass
class Outcome:
    """How a generation ended, before it is committed."""

    finish_reason: str
    final_ids: list[int]
    final_text: str
    error: str | None = None
    error_code: str | None = None
    cached_tokens: int = 0


class Intake:
    def __init__(self, *, engine: EngineClient, worker_id: str, claims: ClaimsT, sink: TokenSinkT,
                 finalizer: FinalizerT, offsets: OffsetTracker, prefix: PrefixReaderT, max_in_flight: int,
                 dead_letters: DeadLetters | None = None, retry_delay_s: float = 1.0,
                 give_up_s: float = 60.0, priority_of: Callable[[TopicPartition], int] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._engine = engine
        #: the engine priority of a request from a partition: its work queue's class rank (0 highest)
        self._priority_of = priority_of or (lambda _tp: 0)
        self._worker_id = worker_id
        self._claims = claims
        self._sink = sink
        self._finalizer = finalizer
        self._offsets = offsets
        self._prefix = prefix
        self._max = max_in_flight
        self._dead_letters = dead_letters
        self._retry_delay_s = retry_delay_s
        self._give_up_s = give_up_s
        #: the unattended clock (``Listeners.unattended_since``), shared with the presence check
        self.clock = clock
        self.jobs: dict[str, Job] = {}
        self._controls = RecentControls()
        self._draining = False
        #: set whenever room in the engine's batch may have freed: wakes a generation back from a suspension
        self._room_for_parked = asyncio.Event()
        #: partitions records may be admitted from (owned, and not being rebalanced), with the consumer-group
        #: generation that assigned them: the attempt number of every request admitted from there
        self._active: dict[TopicPartition, int] = {}
        #: called with a partition this worker turns out to have lost (a newer attempt holds one of its requests)
        self.on_stale: Callable[[TopicPartition], Coroutine[object, object, None]] | None = None
        #: NOTE: held while a record is admitted and while the rebalance listener changes ownership
        self.admission = asyncio.Lock()
        #: set whenever a job ends: wakes the paused consumer loop
        self.room_freed = asyncio.Event()
        self.fatal: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        #: a store admission needs is failing (claims in Redis): reported by /health
        self.degraded: str | None = None
        self._background: set[asyncio.Task[None]] = set()

    # --- ownership (called by the rebalance listener, under ``admission``) ----------------------------

    def accepts(self, tp: TopicPartition) -> bool:
        return tp in self._active

    def activate(self, partitions: Iterable[TopicPartition], generation: int) -> None:
        for tp in partitions:
            self._active[tp] = generation

    def suspend(self, partitions: Iterable[TopicPartition]) -> None:
        for tp in partitions:
            self._active.pop(tp, None)

    def fail(self, exc: BaseException) -> None:
        """The worker cannot go on (the rebalance listener could not take its partitions over)."""
        if not self.fatal.done():
            self.fatal.set_exception(exc)

    # --- admission ------------------------------------------------------------------------------------

    def capacity(self) -> int:
        # A suspended generation is out of the engine's batch: its room is the engine's again meanwhile
        return self._max - self._in_batch()

    async def handle(self, request: ChatRequest, record: ConsumerRecord[bytes, bytes]) -> None:
        """Called by the consumer loop for each request record, in partition order."""
        tp = TopicPartition(record.topic, record.partition)
        async with self.admission:
            if tp not in self._active:
                return None  # being rebalanced: the listener seeks the partition back to where it resumes
            taken = self._offsets.classify(tp, record.offset)
            if taken in (Taken.SEEN, Taken.NOT_OURS):
                return None  # a re-fetch of a record already handled here
            WORKER_CONSUMED.inc()
            if record.timestamp:
                KAFKA_HOP.labels(hop="gateway_to_worker").observe(max(0.0, time.time() - record.timestamp / 1000))
            with request_scope(request.request_id):
                if taken is Taken.FINISHED:
                    return self._skip(tp, record.offset, "finished_before")
                if request.request_id in self.jobs:
                    return self._skip(tp, record.offset, "duplicate")
                return await self._admit(request, record, tp)

    async def _admit(self, request: ChatRequest, record: ConsumerRecord[bytes, bytes], tp: TopicPartition) -> None:
        attempt = self._active[tp]
        inherited = self._offsets.inherited(tp, record.offset)
        cancelled = self._controls.stop(request.request_id) is not None
        # Nobody attached (its client dropped while it waited): no head start, it is suspended before any prefill
        attended = request.runs_unattended or self._listeners_of(request).live
        head = self._head_start(request, tp, attempt) if not inherited and not cancelled and attended else None
        started = time.perf_counter()
        try:
            claim = await self._claims.claim(request.request_id, f"{record.topic}:{record.partition}:{record.offset}",
                                             attempt, org_id=request.org_id, key_id=request.key_id)
            WORKER_CLAIM.observe(time.perf_counter() - started)
        except CLAIM_ERRORS as exc:
            await _dropped(head)
            WORKER_DEFERRED.labels(reason="claims_unavailable").inc()
            self.degraded = f"request claims unavailable (Redis): {exc!r}"
            raise RetryLater(self.degraded, self._retry_delay_s) from exc
        except BaseException:
            self._drop(head)  # cancelled: in the background
            raise
        self.degraded = None
        if claim.verdict is not ClaimVerdict.START or claim.previous > 0:
            # Someone else's, finished, or an earlier attempt's to continue: the engine forgets it before anything
            # else of this request reaches it (a takeover's own generation).
            await _dropped(head)
        if claim.verdict is ClaimVerdict.STALE:
            return self._stale(tp, f"attempt {claim.previous} of {request.request_id} outranks ours ({attempt})")
        if claim.verdict is not ClaimVerdict.START:
            return self._skip(tp, record.offset, claim.verdict.value)
        self._offsets.taken(tp, record.offset)
        job = Job(request, tp, record.offset, attempt, child_of(from_headers(record.headers)), started, utcnow())
        job.takeover = claim.previous > 0 or inherited
        job.listeners = self._listeners_of(request)
        early = self._controls.stop(request.request_id)  # read again: one may have come during the claim
        if early is not None:
            # Cancelled while it waited in the backlog (or for its claim): commit it as such, the engine forgets it.
            await _dropped(head)
            job.abort_cause = _cause(early)
            job.billed_by_connections = True
        elif not job.takeover:
            job.head = head
        self.jobs[request.request_id] = job
        WORKER_IN_FLIGHT.set(len(self.jobs))
        job.task = asyncio.create_task(self._run(job), name=f"generate-{request.request_id}")
        # NOTE: a callback, not the coroutine's ``finally``: a task cancelled before its first step never runs it.
        job.task.add_done_callback(partial(self._ended, job))
        log.info("request admitted", extra={"attempt": attempt, "partition": tp.partition,
                                            "offset": record.offset, "takeover": job.takeover})
        return None

    def _listeners_of(self, request: ChatRequest) -> Listeners:
        """The stream's client connections as the control topic has told them so far (a takeover inherits them);
        one left unattended by then has been for as long as its last event is old."""
        listeners = Listeners.of(request.reply.gateway_id)
        history = self._controls.history(request.request_id)
        for event in history:
            listeners.apply(event)
        if history and not listeners.live:
            age_s = (utcnow() - history[-1].issued_at).total_seconds()
            listeners.note(self.clock() - max(0.0, age_s))
        return listeners

    def _head_start(self, request: ChatRequest, tp: TopicPartition, attempt: int) -> HeadStart | None:
        """Give the engine a fresh request before its claim is back, when nothing says it is not fresh (see
        ``head_start.py``). Not while claims are failing (each retry would prefill again for nothing), nor past
        its queue deadline (it is not generated)."""
        if self.degraded is not None or (request.deadline_at is not None and utcnow() > request.deadline_at):
            return None
        return HeadStart(self._engine_deltas(request, tp, attempt, NOTHING_EMITTED))

    def _drop(self, head: HeadStart | None) -> None:
        if head is not None and not head.dropped:
            self._spawn(head.drop())

    def _engine_deltas(self, request: ChatRequest, tp: TopicPartition, attempt: int, prefix: EmittedPrefix
                       ) -> AsyncGenerator[EngineDelta, None]:
        steps = plan(request, prefix)
        return self._engine.generate(f"{request.request_id}#{attempt}", steps.prompt_token_ids, steps.sampling,
                                     priority=self._priority_of(tp))

    def _stale(self, tp: TopicPartition, why: str) -> None:
        """A newer owner holds this partition (this worker missed a rebalance): admit nothing more from it and
        let the listener drop it; the group tells this worker what it owns at its next heartbeat."""
        WORKER_SKIPPED.labels(reason="stale_owner").inc()
        log.warning("a newer owner holds this partition", extra={"partition": tp.partition, "why": why})
        self.suspend([tp])
        if self.on_stale is not None:
            self._spawn(self.on_stale(tp))

    def _skip(self, tp: TopicPartition, offset: int, reason: str) -> None:
        WORKER_SKIPPED.labels(reason=reason).inc()
        log.info("request record skipped", extra={"reason": reason, "offset": offset})
        self._offsets.taken(tp, offset, open_=False)
        self._finalizer.commit_offsets_soon(tp)

    async def undecodable(self, record: ConsumerRecord[bytes, bytes], exc: DecodeError) -> None:
        """A request record no released schema decodes: dead-letter it, and tell its client at once when the
        record's headers say who that is (a newer gateway's schema this worker does not know yet)."""
        tp = TopicPartition(record.topic, record.partition)
        if self._dead_letters is not None:
            await self._dead_letters.send(record, str(exc))
        async with self.admission:
            if tp not in self._active or self._offsets.classify(tp, record.offset) is not Taken.NEW:
                return
            address = reply_address(record.headers)
            if address is None:
                return self._skip(tp, record.offset, "undecodable")
            WORKER_SKIPPED.labels(reason="undecodable").inc()
            self._offsets.taken(tp, record.offset)
        request_id, partition = address
        final = TokenEvent(request_id=request_id, attempt=1, seq=0, token_offset=0, token_ids=[], text="",
                           finish_reason="error", worker_id=self._worker_id, emitted_at_us=_now_us(),
                           error=f"this worker cannot read the request ({exc}); it was not generated",
                           error_code=ErrorCode.UNDECODABLE_REQUEST.value)
        self._spawn(self._finish_quietly(Finished(final, None, partition, tp, record.offset, None, None)))

    async def _finish_quietly(self, item: Finished) -> None:
        with contextlib.suppress(PartitionLost):
            await self._finalizer.finish(item)

    def _spawn(self, coro: Coroutine[object, object, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # --- control --------------------------------------------------------------------------------------

    def on_control(self, event: ControlEvent) -> None:
        self._controls.remember(event)
        job = self.jobs.get(event.request_id)
        if job is None:
            return
        job.listeners.apply(event)
        if not event.stops:
            self.listeners_changed(job)
            log.info("client connection changed", extra={"request_id": event.request_id, "action": event.action.value,
                                                          "attachment": event.attachment,
                                                          "attended": job.listeners.live})
            return
        log.info("aborting on control event", extra={"request_id": event.request_id,
                                                      "action": event.action.value, "reason": event.reason})
        if job.abort_cause is None:
            job.billed_by_connections = True
        self._abort(job, _cause(event))

    def listeners_changed(self, job: Job, now: float | None = None) -> None:
        """The connections as they now stand (the control topic, or a presence check at ``now``): start or stop the
        unattended clock, and let a suspended generation go on once a client is attached again."""
        job.listeners.note(self.clock() if now is None else now)
        if job.listeners.live and job.attended is not None and not job.attended.is_set():
            job.attended.set()
            self.room_freed.set()

    def cancel_unattended(self, request_id: str) -> bool:
        """No client connection has been attached to this stream for its window: stop generating it, billed for the
        most any connection received (``Listeners.received_cap``)."""
        job = self.jobs.get(request_id)
        if job is None or job.listeners.live:
            return False
        if job.abort_cause is None:
            job.billed_by_connections = True
        self._abort(job, "unattended")
        return True

    def _abort(self, job: Job, cause: str) -> None:
        if job.abort_cause is not None or job.task is None or job.finalizing:
            return
        job.abort_cause = cause
        job.task.cancel()

    async def abort_partitions(self, partitions: Iterable[TopicPartition], cause: str,
                               only: Callable[[Job], bool] | None = None) -> None:
        """Stop generating the requests of these partitions (moved, or the worker is stopping)."""
        moved = set(partitions)
        jobs = [j for j in self.jobs.values()
                if j.source in moved and j.task is not None and (only is None or only(j))]
        for job in jobs:
            job.abort_cause = cause  # overrides a pending cancel: the next owner commits that one
            assert job.task is not None
            job.task.cancel()
        await asyncio.gather(*(j.task for j in jobs if j.task is not None), return_exceptions=True)

    async def drain(self, timeout_s: float) -> None:
        """Let running requests finish (graceful stop); whatever remains after the timeout is aborted. A suspended
        one (nobody attached) is aborted at once, left to the partition's next owner, as is one that would suspend
        meanwhile: no window can end while the worker stops."""
        self._draining = True
        await self.abort_partitions({j.source for j in self.jobs.values() if j.suspended}, "shutdown",
                                    only=lambda j: j.suspended)
        tasks = [j.task for j in self.jobs.values() if j.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)
        await self.abort_partitions({j.source for j in self.jobs.values()}, "shutdown")
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)

    # --- generation -----------------------------------------------------------------------------------

    async def _run(self, job: Job) -> None:
        with request_scope(job.request.request_id):
            try:
                outcome = await self._generate(job)
                if outcome is not None:
                    await self._finalize(job, outcome)
            except EngineDeadError as exc:
                if not self.fatal.done():
                    self.fatal.set_exception(exc)
            except asyncio.CancelledError:
                pass  # moved or stopping: the next owner takes it over
            except PartitionLost:
                log.info("partition moved before the commit; its new owner finishes the request")

    def _ended(self, job: Job, _task: asyncio.Task[None]) -> None:
        self._drop(job.head)  # dropped already when read; else aborted, expired or stopped before it ran
        if self.jobs.get(job.request.request_id) is job:
            del self.jobs[job.request.request_id]
        WORKER_IN_FLIGHT.set(len(self.jobs))
        self.room_freed.set()
        self._room_for_parked.set()

    async def _generate(self, job: Job) -> Outcome | None:
        """Run the engine; the outcome to commit, or None when nothing is committed (moved, stopping)."""
        try:
            if job.takeover:
                finished = await self._take_over(job)
                if finished is not None:
                    return finished
            if job.abort_cause is not None:
                raise asyncio.CancelledError
            if _past_deadline(job):
                await _dropped(job.head)  # it is not generated: the engine forgets it before the commit
                return _expired(job)
            return await self._stream(job)
        except asyncio.CancelledError:
            # The engine forgets it before the commit (a no-op once read). A second cancel meanwhile (a revocation
            # after an abort) does not skip what follows: the cause it set decides.
            with contextlib.suppress(asyncio.CancelledError):
                await _dropped(job.head)
            cause = job.abort_cause or "shutdown"
            WORKER_ABORTED.labels(cause=cause).inc()
            finish_reason = ABORT_OUTCOMES.get(cause)
            if finish_reason is None:
                raise
            current = asyncio.current_task()
            if current is not None:
                current.uncancel()
            return Outcome(finish_reason, [], "")
        except EngineDeadError:
            raise
        except Diverged as exc:
            return Outcome("error", [], "", f"failover could not continue the stream exactly: {exc}",
                           ErrorCode.STREAM_INCONSISTENT.value)
        except KafkaError:
            log.exception("token delivery failed", extra={"request_id": job.request.request_id})
            return Outcome("error", [], "", "token delivery failed", ErrorCode.TOKEN_DELIVERY_FAILED.value)
        except Exception:  # one failed request (engine rejected it, bad params): never the worker
            # The engine's own words (paths, device state, library versions) stay in the worker's log: the final
            # event's error reaches the client (security review L4)
            log.exception("generation failed", extra={"request_id": job.request.request_id})
            return Outcome("error", [], "", ENGINE_FAILED, ErrorCode.GENERATION_FAILED.value)

    async def _take_over(self, job: Job) -> Outcome | None:
        """Read what earlier attempts emitted. An outcome when the stream already ended (nothing to generate)."""
        # NOTE: shielded: a cancel or halt arriving meanwhile is handled once the prefix is known, so that what
        # the client already received is billed and the final lands after it.
        reading = asyncio.ensure_future(self._read_prefix(job))
        try:
            prefix = await asyncio.shield(reading)
        except asyncio.CancelledError:
            prefix = await reading
            self._took_over(job, prefix)
            raise
        self._took_over(job, prefix)
        if prefix.attempt >= job.attempt:
            # A newer owner already emitted for it: this worker missed a rebalance. Touch nothing.
            self._stale(job.source, f"attempt {prefix.attempt} emitted for {job.request.request_id}")
            job.abort_cause = "revoked"
            raise asyncio.CancelledError
        if prefix.final is not None:
            WORKER_TAKEOVERS.labels(mode="finished_before").inc()
            final = prefix.final
            job.ran = final.usage is not None and final.usage.prompt_tokens > 0
            return Outcome(final.finish_reason or "stop", [], "", final.error, final.error_code,
                           final.usage.cached_tokens if final.usage else 0)
        if prefix.error is not None:
            WORKER_TAKEOVERS.labels(mode="stream_failed").inc()
            return Outcome("error", [], "", prefix.error, ErrorCode.STREAM_INCONSISTENT.value)
        if prefix.tokens >= job.request.sampling.max_tokens:
            WORKER_TAKEOVERS.labels(mode="complete").inc()
            return Outcome("length", [], "")
        WORKER_TAKEOVERS.labels(mode="replay" if plan(job.request, prefix).replay.tokens else "continue").inc()
        return None

    @staticmethod
    def _took_over(job: Job, prefix: EmittedPrefix) -> None:
        job.prefix, job.tokens, job.ran = prefix, prefix.tokens, prefix.tokens > 0
        job.emitted_ids, job.emitted_text = list(prefix.token_ids), [prefix.text]
        # What earlier attempts emitted was relayed by some gateway, or is resumable: a later unattended cancel
        # bills at least that (a new Job knows nothing of the presence checks of the attempts before it).
        job.listeners.took_over(prefix.tokens)
        if job.request.keeps_record:
            job.text_parts = [prefix.text]

    async def _read_prefix(self, job: Job) -> EmittedPrefix:
        """What the request emitted, retried while Kafka is unreachable: without it, neither what to generate
        nor what to bill is known. Past ``give_up_s`` the worker stops (restarted, its partitions move)."""
        first_offset = None
        with contextlib.suppress(*CLAIM_ERRORS):  # unknown: read from the request's creation time instead
            first_offset = await self._claims.first_offset(job.request.request_id)
        failing_since, delay = None, 0.2
        while True:
            try:
                return await self._prefix.read(job.request, first_offset)
            except (KafkaError, TimeoutError) as exc:
                # Counted from the first failure, not the first try: reads wait their turn behind one another's
                # (one reader), and a read-back queued behind others' is not itself a failure.
                failing_since = failing_since or time.monotonic()
                if time.monotonic() - failing_since > self._give_up_s:
                    # Nothing is committed: the partition's next owner reads it again.
                    self.fail(FatalError(f"cannot read what {job.request.request_id} emitted: {exc!r}"))
                    job.abort_cause = "shutdown"
                    raise asyncio.CancelledError from exc
                log.warning("emitted prefix unreadable; retrying", extra={"reason": repr(exc)})
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def _stream(self, job: Job) -> Outcome:
        while True:
            if not job.listeners.live and not job.request.runs_unattended:
                # Nobody to receive it, before any prefill (a head start, a takeover of a suspended stream)
                await _dropped(job.head)
                job.head = None
                await self._suspend(job)
            outcome = await self._generate_attended(job)
            if outcome is not None:
                return outcome

    async def _generate_attended(self, job: Job) -> Outcome | None:
        """Generate while some client is attached; None once none is (the engine has forgotten the request)."""
        request = job.request
        steps = plan(request, job.prefix)
        replay = ReplayFilter(steps.replay) if steps.replay.tokens else None
        job.ran = True
        output = (job.head.deltas() if job.head is not None else
                  self._engine_deltas(request, job.source, job.attempt, job.prefix))
        job.head = None  # read once: a generation that goes on after a suspension starts anew
        # NOTE: closed on every exit, so the engine aborts the request at once (not when the generator is collected).
        async with contextlib.aclosing(output) as deltas:
            return await self._relay_deltas(job, deltas, replay)

    async def _suspend(self, job: Job) -> None:
        """Nobody is attached: wait out of the engine for a client to come back (a cancel, the window's end or a
        revocation ends the wait by cancelling this task), then for room in the engine's batch (others were
        admitted in its room meanwhile); then continue from what was emitted."""
        if self._draining:
            job.abort_cause = job.abort_cause or "shutdown"
            raise asyncio.CancelledError  # no window ends while the worker stops: the next owner takes it over
        job.attended, job.parked = asyncio.Event(), True
        if job.listeners.live:  # back already (an ATTACH while the engine aborted the generation)
            job.attended.set()
        self.room_freed.set()  # its room in the engine's batch is free while it waits
        self._room_for_parked.set()
        WORKER_SUSPENDED.inc()
        started = time.perf_counter()
        log.info("no client attached: generation suspended", extra={"tokens": job.tokens})
        try:
            await job.attended.wait()
            # NOTE: the check and the unparking are one step (no await between): the consumer loop sees the room taken
            while self._in_batch() >= self._max:
                self._room_for_parked.clear()
                await self._room_for_parked.wait()
            job.parked = False
        finally:
            job.attended, job.parked = None, False
            job.suspended_s += time.perf_counter() - started
            WORKER_SUSPENDED.dec()
        job.prefix = EmittedPrefix(list(job.emitted_ids), "".join(job.emitted_text), job.attempt)
        log.info("a client is attached again: generation goes on", extra={"tokens": job.tokens})

    def _in_batch(self) -> int:
        """Jobs in (or about to enter) the engine's batch."""
        return sum(1 for job in self.jobs.values() if not job.suspended)

    async def _relay_deltas(self, job: Job, deltas: AsyncGenerator[EngineDelta, None], replay: ReplayFilter | None
                            ) -> Outcome | None:
        """Emit what the engine gives; the outcome when it ends, None when no client is attached any more."""
        request = job.request
        cached = 0
        async for delta in deltas:
            cached = delta.cached_tokens
            ids, text = replay.feed(delta.token_ids, delta.text) if replay else (delta.token_ids, delta.text)
            if replay is not None and len(ids) < len(delta.token_ids):
                WORKER_REPLAYED_TOKENS.inc(len(delta.token_ids) - len(ids))
            if not job.listeners.live and not request.runs_unattended:
                # Nobody to receive it: not emitted (its generation goes on from the log's end when a client is back)
                WORKER_UNATTENDED_TOKENS.inc(len(ids))
                return None
            if delta.finish_reason is not None:
                return Outcome(delta.finish_reason, ids, text, cached_tokens=cached)
            if not ids and not text:
                continue
            if job.seq == 0 and job.tokens == job.prefix.tokens:  # this attempt's first emission, once
                WORKER_TTFT.observe(time.perf_counter() - job.admitted_at - job.suspended_s)
            out = self._delta(job, ids, text)  # raises here, in this request's own task, on what is not a delta
            ids, text = out.token_ids, out.text
            delivery = await self._sink.emit(out, request.reply.partition, job.traceparent)
            first_of_request = job.seq == 0 and not job.prefix.tokens
            job.in_flight.add(delivery)
            delivery.add_done_callback(partial(self._delivered, job, job.tokens, first_of_request))
            job.seq += 1
            job.last_delivery = delivery
            job.tokens += len(ids)
            job.emitted_ids += ids
            job.emitted_text.append(text)
            if request.keeps_record:
                job.text_parts.append(text)
        return Outcome("error", [], "", "the engine ended the stream without a finish reason",
                       ErrorCode.GENERATION_FAILED.value)

    def _delivered(self, job: Job, token_offset: int, first: bool, delivery: Delivery) -> None:
        job.in_flight.discard(delivery)
        if delivery.cancelled() or delivery.exception() is not None:
            if job.undelivered_from is None or token_offset < job.undelivered_from:
                job.undelivered_from = token_offset
            log.error("token delta not delivered", extra={"request_id": job.request.request_id,
                                                          "reason": repr(delivery.exception()
                                                                         if not delivery.cancelled() else None)})
            self._abort(job, "delivery")
        elif first:
            metadata = delivery.result()
            self._spawn(self._record_first_offset(job.request.request_id, metadata.offset))

    async def _record_first_offset(self, request_id: str, offset: int) -> None:
        with contextlib.suppress(*CLAIM_ERRORS):  # else a takeover searches from the request's creation time
            await self._claims.record_first_offset(request_id, offset)

    def _delta(self, job: Job, token_ids: list[int], text: str) -> Delta:
        """A non-final event: no model on this path (one per running request per engine step) unless the engine
        gave something else than a str and ints. Then the model validates it (coerces, or raises for this request
        alone): an unchecked bad delta would make its whole record unwritable, ending every stream it carries."""
        if type(text) is not str or any(type(t) is not int for t in token_ids):
            event = self._event(job, job.seq, token_ids, text)
            token_ids, text = event.token_ids, event.text
        return Delta(job.request.request_id, job.attempt, job.seq, job.tokens, token_ids, text, self._worker_id,
                     _now_us())

    def _event(self, job: Job, seq: int, token_ids: list[int], text: str, **final: object) -> TokenEvent:
        return TokenEvent(request_id=job.request.request_id, attempt=job.attempt, seq=seq,
                          token_offset=job.tokens, token_ids=token_ids, text=text, worker_id=self._worker_id,
                          emitted_at_us=_now_us(), **final)

    async def _finalize(self, job: Job, outcome: Outcome) -> None:
        request = job.request
        job.finalizing = True
        if job.in_flight:
            # Every delta acknowledged (or failed) first: what the client can have decides the final and the bill.
            # ``wait``, not ``gather``: a cancelled gather cancels what it waits for, and a delivery future is
            # shared by every request whose delta its record carries (token_sink.py).
            await asyncio.wait(set(job.in_flight))
        # A stopped generation is billed by the rule of ``listeners.py`` (decided when it was stopped); a finished one
        # whole.
        received = (job.listeners.received_cap(job.tokens)
                    if outcome.finish_reason == "cancelled" and job.billed_by_connections else None)
        if job.undelivered_from is not None and received is None:
            # The client cannot have more than what reached its gateway: bill that, end the stream in error.
            outcome = Outcome("error", [], "", "a token delta could not be delivered to the client's gateway",
                              ErrorCode.TOKEN_DELIVERY_FAILED.value, outcome.cached_tokens)
        completion = job.tokens + len(outcome.final_ids)
        if job.undelivered_from is not None:
            # What the log holds is the most any client can have (a gateway's count came from it too)
            landed = await self._landed(job)
            completion = landed if received is None else min(received, landed)
        elif received is not None:
            completion = received
        prompt = len(request.prompt_token_ids)
        # A prompt the engine processed is billed whoever stopped the generation (a cancel before the first token
        # costs a prefill: without this, a loop of big prompts cancelled at once was free GPU work), except when the
        # platform failed to deliver its tokens
        billed = completion > 0 or (job.ran and job.abort_cause != "delivery")
        cached = min(outcome.cached_tokens, prompt)
        usage = TokenUsage(prompt_tokens=prompt if billed else 0, completion_tokens=completion,
                           cached_tokens=cached if billed else 0)
        final = self._event(job, job.seq, outcome.final_ids, outcome.final_text, finish_reason=outcome.finish_reason,
                            usage=usage, error=outcome.error, error_code=outcome.error_code)
        record = UsageEvent(
            request_id=request.request_id, org_id=request.org_id, key_id=request.key_id, tier=request.tier,
            model=request.model, prompt_tokens=usage.prompt_tokens, completion_tokens=completion,
            cached_tokens=usage.cached_tokens, finish_reason=outcome.finish_reason, attempt=job.attempt,
            worker_id=self._worker_id, requested_at=request.created_at, started_at=job.started_at,
            finished_at=utcnow(), conversation_id=request.conversation_id,
        ) if billed else None
        WORKER_TOKENS_OUT.inc(len(outcome.final_ids))
        stored = (StoredCompletion.of(request, "".join(job.text_parts) + outcome.final_text, final)
                  if request.keeps_record else None)
        await self._finalizer.finish(Finished(final, record, request.reply.partition, job.source, job.offset,
                                              job.traceparent, job.last_delivery, stored=stored))
        WORKER_FINISHED.labels(finish_reason=outcome.finish_reason).inc()
        log.info("request finished", extra={"finish_reason": outcome.finish_reason, "completion_tokens": completion,
                                            "attempt": job.attempt, "billed": billed})

    async def _landed(self, job: Job) -> int:
        """Completion tokens the client can have after a delta the producer reports undelivered. That report does not
        say the record is missing: the broker may have appended it and its answer been lost (it stopped, the
        connection dropped), and the client's relay then reads it. So the log is read back, merged as the relay
        merges it (a record really missing ends that merge at the gap, as it ends the client's stream)."""
        prefix = await self._read_prefix(job)
        if prefix.attempt > job.attempt:
            # A newer owner emits for it: this worker missed a rebalance, and its commit would be fenced.
            self._stale(job.source, f"attempt {prefix.attempt} emitted for {job.request.request_id}")
            job.abort_cause = "revoked"
            raise asyncio.CancelledError
        # Tokens of a stalled predecessor that landed after this attempt's takeover read count too: the client has
        # them, and nobody else bills them.
        landed = prefix.tokens
        if landed != job.undelivered_from:
            log.warning("undelivered token delta found on the log", extra={
                "request_id": job.request.request_id, "acknowledged_tokens": job.undelivered_from,
                "landed_tokens": landed})
        return landed

    def state(self) -> list[dict[str, object]]:
        return [job.describe() for job in self.jobs.values()]


async def _dropped(head: HeadStart | None) -> None:
    if head is not None:
        await head.drop()


def _past_deadline(job: Job) -> bool:
    """Generation would start after the request's queue deadline, and its client has nothing yet."""
    deadline = job.request.deadline_at
    return deadline is not None and not job.prefix.tokens and utcnow() > deadline


def _expired(job: Job) -> Outcome:
    deadline = job.request.deadline_at
    waited = (utcnow() - job.request.created_at).total_seconds()
    return Outcome("error", [], "", f"the request waited {waited:.0f} s in the queue, past its deadline "
                   f"({deadline.isoformat() if deadline else '?'}); it was not generated and is not billed",
                   ErrorCode.QUEUE_DEADLINE_EXCEEDED.value)


def _cause(event: ControlEvent) -> str:
    return "halt" if event.action is ControlAction.HALT else "cancel"
