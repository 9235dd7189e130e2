"""Admission and generation: from a request record to token events and a finished request.

The consumer loop (``runtime.kafka_clients.consume``) asks :meth:`Intake.capacity` before each fetch, so the
worker never holds more requests than the engine batches; each admitted request runs in its own task around
``engine.generate()``. A task ends in one of three ways:

* finished by the engine (stop, length, error): its final event and usage are committed by the Finalizer;
* aborted by a control event (cancel → "cancelled", halt → "content_filter"): same, with the tokens so far;
* aborted because its partition was revoked or the worker is stopping: nothing is committed, Kafka
  redelivers the request and it is generated again with ``attempt + 1``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

from aiokafka import ConsumerRecord, TopicPartition
from aiokafka.errors import KafkaError

from inference_workers.claims import ClaimVerdict, RequestClaims
from inference_workers.control import RecentControls
from inference_workers.emitter import Delivery, Finalizer, Finished, TokenSink
from inference_workers.offsets import OffsetTracker
from inference_workers.protocol import EngineClient, EngineDeadError
from runtime.logs import request_scope
from runtime.metrics import (
    KAFKA_HOP,
    WORKER_ABORTED,
    WORKER_CONSUMED,
    WORKER_FINISHED,
    WORKER_IN_FLIGHT,
    WORKER_SKIPPED,
    WORKER_TOKENS_OUT,
    WORKER_TTFT,
)
from runtime.tracing import child_of, from_headers
from schemas.events import (
    ChatRequest,
    ControlAction,
    ControlEvent,
    TokenEvent,
    TokenUsage,
    UsageEvent,
    utcnow,
)

log = logging.getLogger(__name__)

#: why a generation was interrupted → the finish reason it is committed with (None: not committed at all)
ABORT_OUTCOMES: dict[str, str | None] = {
    "cancel": "cancelled",
    "halt": "content_filter",
    "revoked": None,
    "shutdown": None,
}


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
    task: asyncio.Task[None] | None = None
    tokens: int = 0
    abort_cause: str | None = None

    def describe(self) -> dict[str, object]:
        return {"request_id": self.request.request_id, "attempt": self.attempt, "tokens": self.tokens,
                "max_tokens": self.request.sampling.max_tokens, "partition": self.source.partition,
                "offset": self.offset, "aborting": self.abort_cause}


class Intake:
    def __init__(self, *, engine: EngineClient, worker_id: str, claims: RequestClaims, sink: TokenSink,
                 finalizer: Finalizer, offsets: OffsetTracker, max_in_flight: int) -> None:
        self._engine = engine
        self._worker_id = worker_id
        self._claims = claims
        self._sink = sink
        self._finalizer = finalizer
        self._offsets = offsets
        self._max = max_in_flight
        self.jobs: dict[str, Job] = {}
        self._controls = RecentControls()
        #: set whenever a job ends: wakes the paused consumer loop
        self.room_freed = asyncio.Event()
        self.fatal: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    # --- admission ------------------------------------------------------------------------------------

    def capacity(self) -> int:
        return self._max - len(self.jobs)

    async def handle(self, request: ChatRequest, record: ConsumerRecord[bytes, bytes]) -> None:
        """Called by the consumer loop for each request record, in partition order."""
        WORKER_CONSUMED.inc()
        tp = TopicPartition(record.topic, record.partition)
        self._offsets.taken(tp, record.offset)
        if record.timestamp:
            KAFKA_HOP.labels(hop="gateway_to_worker").observe(max(0.0, time.time() - record.timestamp / 1000))
        with request_scope(request.request_id):
            if request.request_id in self.jobs:
                # Another record of a request generating here now: a duplicate (a fetched-again record of a
                # running request cannot occur: a rebalance aborts running requests first).
                return self._skip(tp, record.offset, "duplicate")
            claim = await self._claims.claim(request.request_id, f"{record.topic}:{record.partition}:{record.offset}",
                                             org_id=request.org_id, key_id=request.key_id)
            if claim.verdict is not ClaimVerdict.START:
                return self._skip(tp, record.offset, claim.verdict.value)
            job = Job(request, tp, record.offset, claim.attempt, child_of(from_headers(record.headers)),
                      time.perf_counter(), utcnow())
            self.jobs[request.request_id] = job
            WORKER_IN_FLIGHT.set(len(self.jobs))
            early = self._controls.get(request.request_id)
            if early is not None:
                # Cancelled while it waited in the backlog: commit it as such, the engine never sees it.
                job.abort_cause = _cause(early)
            job.task = asyncio.create_task(self._run(job), name=f"generate-{request.request_id}")
            log.info("request admitted", extra={"attempt": claim.attempt, "partition": tp.partition,
                                                "offset": record.offset})
        return None

    def _skip(self, tp: TopicPartition, offset: int, reason: str) -> None:
        WORKER_SKIPPED.labels(reason=reason).inc()
        log.info("request record skipped", extra={"reason": reason, "offset": offset})
        self._offsets.done(tp, offset)
        self._finalizer.commit_offsets_soon()

    # --- control --------------------------------------------------------------------------------------

    def on_control(self, event: ControlEvent) -> None:
        self._controls.remember(event)
        job = self.jobs.get(event.request_id)
        if job is None or job.abort_cause is not None or job.task is None:
            return
        job.abort_cause = _cause(event)
        log.info("aborting on control event", extra={"request_id": event.request_id,
                                                      "action": event.action.value, "reason": event.reason})
        job.task.cancel()

    async def abort_partitions(self, partitions: Iterable[TopicPartition], cause: str) -> None:
        """Stop generating the requests of these partitions (revoked, or the worker is stopping)."""
        revoked = set(partitions)
        jobs = [j for j in self.jobs.values() if j.source in revoked and j.task is not None]
        for job in jobs:
            job.abort_cause = job.abort_cause or cause
            assert job.task is not None
            job.task.cancel()
        await asyncio.gather(*(j.task for j in jobs if j.task is not None), return_exceptions=True)

    async def drain(self, timeout_s: float) -> None:
        """Let running requests finish (graceful stop); whatever remains after the timeout is aborted."""
        tasks = [j.task for j in self.jobs.values() if j.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)
        await self.abort_partitions({j.source for j in self.jobs.values()}, "shutdown")

    # --- generation -----------------------------------------------------------------------------------

    async def _run(self, job: Job) -> None:
        with request_scope(job.request.request_id):
            try:
                await self._generate(job)
            except EngineDeadError as exc:
                if not self.fatal.done():
                    self.fatal.set_exception(exc)
            except asyncio.CancelledError:
                pass  # revoked or stopping: Kafka redelivers it
            finally:
                self.jobs.pop(job.request.request_id, None)
                WORKER_IN_FLIGHT.set(len(self.jobs))
                self.room_freed.set()

    async def _generate(self, job: Job) -> None:
        request = job.request
        seq = 0
        last: Delivery | None = None
        cached = 0
        final_ids: list[int] = []
        final_text = ""
        finish_reason: str | None = None
        error: str | None = None
        try:
            if job.abort_cause is not None:
                raise asyncio.CancelledError
            stream = self._engine.generate(request.request_id, request.prompt_token_ids, request.sampling)
            async for delta in stream:
                if seq == 0 and job.tokens == 0:
                    WORKER_TTFT.observe(time.perf_counter() - job.admitted_at)
                cached = delta.cached_tokens
                if delta.finish_reason is not None:
                    finish_reason, final_ids, final_text = delta.finish_reason, delta.token_ids, delta.text
                    break
                if not delta.token_ids and not delta.text:
                    continue
                last = await self._sink.emit(self._event(job, seq, delta.token_ids, delta.text),
                                             request.reply.partition, job.traceparent)
                seq += 1
                job.tokens += len(delta.token_ids)
                WORKER_TOKENS_OUT.inc(len(delta.token_ids))
        except asyncio.CancelledError:
            cause = job.abort_cause or "shutdown"
            WORKER_ABORTED.labels(cause=cause).inc()
            outcome = ABORT_OUTCOMES.get(cause)
            if outcome is None:
                raise
            current = asyncio.current_task()
            if current is not None:
                current.uncancel()
            finish_reason = outcome
        except EngineDeadError:
            raise
        except KafkaError as exc:
            finish_reason, error = "error", f"token delivery failed: {exc!r}"
        except Exception as exc:  # one failed request (engine rejected it, bad params): never the worker
            log.exception("generation failed")
            finish_reason, error = "error", f"{type(exc).__name__}: {exc}"
        WORKER_TOKENS_OUT.inc(len(final_ids))
        await self._finalize(job, seq, final_ids, final_text, finish_reason or "error", error, cached, last)

    def _event(self, job: Job, seq: int, token_ids: list[int], text: str, **final: object) -> TokenEvent:
        return TokenEvent(request_id=job.request.request_id, attempt=job.attempt, seq=seq,
                          token_offset=job.tokens, token_ids=token_ids, text=text, worker_id=self._worker_id,
                          emitted_at_us=_now_us(), **final)

    async def _finalize(self, job: Job, seq: int, final_ids: list[int], final_text: str, finish_reason: str,
                        error: str | None, cached: int, last: Delivery | None) -> None:
        request = job.request
        ran = job.abort_cause is None or job.tokens > 0 or bool(final_ids)
        prompt_tokens = len(request.prompt_token_ids) if ran else 0
        completion_tokens = job.tokens + len(final_ids)
        usage = TokenUsage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, cached_tokens=cached)
        final = self._event(job, seq, final_ids, final_text, finish_reason=finish_reason, usage=usage, error=error)
        record = UsageEvent(
            request_id=request.request_id, org_id=request.org_id, key_id=request.key_id, tier=request.tier,
            model=request.model, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
            cached_tokens=cached, finish_reason=finish_reason, attempt=job.attempt, worker_id=self._worker_id,
            requested_at=request.created_at, started_at=job.started_at, finished_at=utcnow(),
            conversation_id=request.conversation_id,
        )
        await self._finalizer.finish(Finished(final, record, request.reply.partition, job.source, job.offset,
                                              job.traceparent, last))
        WORKER_FINISHED.labels(finish_reason=finish_reason).inc()
        log.info("request finished", extra={"finish_reason": finish_reason, "completion_tokens": completion_tokens,
                                            "attempt": job.attempt})

    def state(self) -> list[dict[str, object]]:
        return [job.describe() for job in self.jobs.values()]


def _cause(event: ControlEvent) -> str:
    return "halt" if event.action is ControlAction.HALT else "cancel"
