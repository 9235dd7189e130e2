"""A fresh request goes to the engine while its claim is on its way (``inference_workers/head_start.py``): the
engine has it before the claim's verdict, nothing is emitted before that verdict, and every verdict but a fresh
START leaves the engine without it before anything else of the request reaches the engine."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from typing import Any

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from inference_workers.engine import VllmEngine
from inference_workers.head_start import HeadStart
from inference_workers.intake import ENGINE_FAILED
from schemas.errors import RetryLater
from schemas.events import ChatRequest, ControlAction, ControlEvent, SamplingSpec, utcnow
from tests.fakes.engine import FakeEngine
from tests.fakes.kafka import FakeGroup
from tests.fakes.worker import FakeWorker, pump, request


def held(group: FakeGroup) -> asyncio.Event:
    group.claims.hold = asyncio.Event()
    return group.claims.hold


async def owning(engine: FakeEngine | None = None) -> tuple[FakeGroup, FakeWorker]:
    """A worker that owns partition 0."""
    group = FakeGroup()
    worker = FakeWorker("w1", group, engine or FakeEngine())
    await worker.assign(0)
    return group, worker


async def handled_behind_a_held_claim(group: FakeGroup, worker: FakeWorker, req: ChatRequest
                                      ) -> tuple[asyncio.Event, asyncio.Future[None]]:
    """The request's record handled up to its claim, which waits for the returned event."""
    claim = held(group)
    handling = asyncio.ensure_future(worker.handle(req, 0, 0))
    await pump()
    return claim, handling


def cancel(request_id: str) -> ControlEvent:
    return ControlEvent(request_id=request_id, action=ControlAction.CANCEL, reason="client_disconnected",
                        issued_by="gw/1", issued_at=utcnow(), delivered_tokens=0)


async def test_the_engine_has_a_fresh_request_before_its_claim_is_back_and_nothing_is_emitted_before() -> None:
    group, worker = await owning()
    req = request(max_tokens=5)
    claim, handling = await handled_behind_a_held_claim(group, worker, req)
    generation = worker.engine.generation(req.request_id)
    assert generation.prompt == req.prompt_token_ids and generation.emitted  # prefilled, first token out
    assert group.log.events(req.request_id) == [] and worker.intake.jobs == {}  # nothing emitted, no job
    claim.set()
    await handling
    await worker.settle()
    text, stream = group.log.client_view(req.request_id)
    assert stream.final is not None and stream.error is None and stream.tokens == 5
    assert len(worker.engine.generations) == 1  # the head start's generation is the request's generation
    assert text == "".join(event.text for event in group.log.events(req.request_id))


async def test_a_head_start_streams_what_a_start_after_the_claim_streams() -> None:
    texts = []
    for hold in (False, True):
        group = FakeGroup()
        worker = FakeWorker("w1", group)
        await worker.assign(0)
        req = request(max_tokens=7, temperature=0.0)
        claim = held(group) if hold else None
        handling = asyncio.ensure_future(worker.handle(req, 0, 0))
        await pump()
        if claim is not None:
            claim.set()
        await handling
        await worker.settle()
        text, stream = group.log.client_view(req.request_id)
        assert stream.tokens == 7 and stream.final is not None
        texts.append(text)
    assert texts[0] == texts[1]


@pytest.mark.parametrize("verdict", ["duplicate", "done", "stale"])
async def test_a_claim_that_is_not_ours_leaves_the_engine_without_the_request(verdict: str) -> None:
    group, worker = await owning(FakeEngine(auto=False))
    req = request()
    group.claims.claims[req.request_id] = {
        "duplicate": {"src": "requests:0:99", "attempt": 1, "before": 0},
        "done": {"src": "requests:0:0", "attempt": 1, "before": 0, "done": 1},
        "stale": {"src": "requests:0:0", "attempt": 99, "before": 0},
    }[verdict]
    claim, handling = await handled_behind_a_held_claim(group, worker, req)
    assert not worker.engine.generation(req.request_id).aborted  # in the engine, waiting for its first step
    claim.set()
    await handling
    assert worker.engine.generation(req.request_id).aborted
    assert worker.intake.jobs == {} and group.log.events(req.request_id) == []


async def test_a_takeover_s_head_start_is_gone_from_the_engine_before_its_own_generation_starts() -> None:
    group = FakeGroup()
    first = FakeWorker("w1", group, FakeEngine(auto=False))
    second = FakeWorker("w2", group, FakeEngine(auto=False))
    await first.assign(0)
    req = request(max_tokens=4)
    await first.handle(req, 0, 0)
    first.engine.step(req.request_id, 2)
    await pump()
    await first.assign()
    await second.assign(0)  # w1's partition moves before it committed anything: nothing says "inherited"
    claim, handling = await handled_behind_a_held_claim(group, second, req)
    head = second.engine.generation(req.request_id)
    assert head.prompt == req.prompt_token_ids and not head.aborted
    claim.set()
    await handling
    await pump()
    head_start, takeover = second.engine.generations
    assert head_start is head and head.aborted and head.emitted == []
    assert takeover.prompt == req.prompt_token_ids + first.engine.generation(req.request_id).emitted
    second.engine.step(req.request_id, 2)
    await second.settle()
    _, stream = group.log.client_view(req.request_id)
    assert stream.final is not None and stream.error is None and stream.tokens == 4


async def test_a_claim_redis_cannot_answer_leaves_the_engine_without_the_request() -> None:
    group, worker = await owning(FakeEngine(auto=False))
    req = request()
    group.claims.fail_with = RedisConnectionError("Redis restarting")
    claim, handling = await handled_behind_a_held_claim(group, worker, req)
    claim.set()
    with pytest.raises(RetryLater):
        await handling
    assert worker.engine.generation(req.request_id).aborted
    # While claims fail, the retries do not prefill again and again.
    generations = len(worker.engine.generations)
    with pytest.raises(RetryLater):
        await worker.handle(req, 0, 0)
    assert len(worker.engine.generations) == generations


async def test_a_request_cancelled_in_the_backlog_gets_no_head_start() -> None:
    group, worker = await owning(FakeEngine(auto=False))
    req = request()
    worker.intake.on_control(cancel(req.request_id))
    await worker.handle(req, 0, 0)
    await worker.settle()
    assert worker.engine.generations == []
    _, stream = group.log.client_view(req.request_id)
    assert stream.final is not None and stream.final.finish_reason == "cancelled"


async def test_a_job_aborted_before_it_reads_its_head_start_leaves_the_engine_without_it() -> None:
    _, worker = await owning(FakeEngine(auto=False))
    req = request()
    await worker.handle(req, 0, 0)
    (job,) = worker.intake.jobs.values()
    assert job.head is not None
    await worker.assign()  # revoked at once: the job's task is cancelled before it ran a step
    await worker.settle()
    await pump()
    assert all(g.aborted for g in worker.engine.generations)


async def test_an_engine_that_refuses_a_head_start_fails_the_request_as_it_would_without_one() -> None:
    group, worker = await owning()
    worker.engine.fail_with = ValueError("prompt too long")
    req = request()
    claim, handling = await handled_behind_a_held_claim(group, worker, req)
    claim.set()
    await handling
    await worker.settle()
    _, stream = group.log.client_view(req.request_id)
    assert stream.final is not None and stream.final.error_code == "generation_failed"
    assert stream.final.error == ENGINE_FAILED  # the engine's words stay in the worker's log


async def test_a_cancel_that_arrives_while_the_claim_is_under_way_is_honoured() -> None:
    """Review: the backlog's cancels were read before the claim, and one arriving during it was lost (the request
    was generated and billed in full for a client that had hung up)."""
    group, worker = await owning()
    req = request(max_tokens=50)
    claim, handling = await handled_behind_a_held_claim(group, worker, req)
    worker.intake.on_control(cancel(req.request_id))  # the client hangs up while the claim is on its way
    claim.set()
    await handling
    await worker.settle()
    _, stream = group.log.client_view(req.request_id)
    assert stream.final is not None and stream.final.finish_reason == "cancelled"
    assert stream.tokens == 0 and all(g.aborted for g in worker.engine.generations)


async def test_a_job_cancelled_before_its_task_first_ran_leaves_neither_engine_request_nor_job() -> None:
    """Review: a task cancelled before its first step never runs its coroutine's ``finally``: the head start ran
    on in the engine unread, and the job stayed in ``jobs`` (a slot lost for good)."""
    _, worker = await owning()
    req = request(max_tokens=20)
    await worker.handle(req, 0, 0)  # START: the job and its task exist; the task has not run a step yet
    (job,) = worker.intake.jobs.values()
    assert job.head is not None
    worker.intake.on_control(cancel(req.request_id))  # handled in the same turn of the loop
    await pump(100)
    assert job.task is not None and job.task.done()
    assert worker.engine.generation(req.request_id).aborted
    assert worker.intake.jobs == {} and worker.intake.capacity() == worker.engine.max_num_seqs


async def test_a_drop_interrupted_by_a_second_cancel_still_aborts_the_engine_request() -> None:
    """Review: a cancel landing inside ``drop()`` (an abort, then a revocation a turn later) skipped the close,
    and every later drop was a no-op."""
    engine = FakeEngine(auto=True)
    head = HeadStart(engine.generate("r#1", [1, 2, 3], SamplingSpec(max_tokens=100)))
    deltas = head.deltas()
    await deltas.__anext__()  # the job read its first delta
    closing = asyncio.ensure_future(deltas.aclose())  # the job's first cancel
    await asyncio.sleep(0)
    closing.cancel()  # the second
    with contextlib.suppress(asyncio.CancelledError):
        await closing
    await pump()
    assert head.dropped and engine.generation("r").aborted


class _Llm:
    """vLLM's AsyncLLM as far as ``VllmEngine.generate`` sees it: it aborts a request on CancelledError or
    GeneratorExit."""

    def __init__(self) -> None:
        self.aborted: list[str] = []

    async def generate(self, prompt: object, params: object, request_id: str) -> AsyncGenerator[Any, None]:
        try:
            while True:
                await asyncio.sleep(0)
                out = type("Completion", (), {"token_ids": [7], "text": " t", "finish_reason": None})()
                yield type("Output", (), {"outputs": [out], "finished": False, "num_cached_tokens": 0})()
        except (asyncio.CancelledError, GeneratorExit):
            self.aborted.append(request_id)
            raise


@pytest.mark.vllm  # vLLM's own SamplingParams and TokensPrompt, through VllmEngine
async def test_a_dropped_head_start_is_aborted_in_vllm_when_drop_returns() -> None:
    """Review: the adapter iterated vLLM's generator without closing it, so closing ours left vLLM's request to the
    garbage collector's asyncgen hook (a turn or more later, after the takeover's own generation could start)."""
    llm = _Llm()
    head = HeadStart(VllmEngine(llm, {"scheduling_policy": "fcfs"}).generate("r#1", [1, 2], SamplingSpec(max_tokens=4)))
    await asyncio.wait({head._first})  # its first output is in: vLLM's generator is suspended after a yield
    await head.drop()
    assert llm.aborted == ["r#1"]
