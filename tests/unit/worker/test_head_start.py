"""A fresh request goes to the engine while its claim is on its way (``inference_workers/head_start.py``): the
engine has it before the claim's verdict, nothing is emitted before that verdict, and every verdict but a fresh
START leaves the engine without it before anything else of the request reaches the engine."""

from __future__ import annotations

import asyncio

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from schemas.errors import RetryLater
from schemas.events import ControlAction, ControlEvent, utcnow
from tests.fakes.engine import FakeEngine
from tests.fakes.kafka import FakeGroup
from tests.fakes.worker import FakeWorker, pump, request


def held(group: FakeGroup) -> asyncio.Event:
    group.claims.hold = asyncio.Event()
    return group.claims.hold


async def test_the_engine_has_a_fresh_request_before_its_claim_is_back_and_nothing_is_emitted_before() -> None:
    group = FakeGroup()
    worker = FakeWorker("w1", group)
    await worker.assign(0)
    req = request(max_tokens=5)
    claim = held(group)
    handling = asyncio.ensure_future(worker.handle(req, 0, 0))
    await pump()
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
    group = FakeGroup()
    worker = FakeWorker("w1", group, FakeEngine(auto=False))
    await worker.assign(0)
    req = request()
    group.claims.claims[req.request_id] = {
        "duplicate": {"src": "requests:0:99", "attempt": 1, "before": 0},
        "done": {"src": "requests:0:0", "attempt": 1, "before": 0, "done": 1},
        "stale": {"src": "requests:0:0", "attempt": 99, "before": 0},
    }[verdict]
    claim = held(group)
    handling = asyncio.ensure_future(worker.handle(req, 0, 0))
    await pump()
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
    claim = held(group)
    handling = asyncio.ensure_future(second.handle(req, 0, 0))
    await pump()
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
    group = FakeGroup()
    worker = FakeWorker("w1", group, FakeEngine(auto=False))
    await worker.assign(0)
    req = request()
    claim = held(group)
    group.claims.fail_with = RedisConnectionError("Redis restarting")
    handling = asyncio.ensure_future(worker.handle(req, 0, 0))
    await pump()
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
    group = FakeGroup()
    worker = FakeWorker("w1", group, FakeEngine(auto=False))
    await worker.assign(0)
    req = request()
    worker.intake.on_control(ControlEvent(request_id=req.request_id, action=ControlAction.CANCEL,
                                          reason="client_disconnected", issued_by="gw/1", issued_at=utcnow(),
                                          delivered_tokens=0))
    await worker.handle(req, 0, 0)
    await worker.settle()
    assert worker.engine.generations == []
    _, stream = group.log.client_view(req.request_id)
    assert stream.final is not None and stream.final.finish_reason == "cancelled"


async def test_a_job_aborted_before_it_reads_its_head_start_leaves_the_engine_without_it() -> None:
    group = FakeGroup()
    worker = FakeWorker("w1", group, FakeEngine(auto=False))
    await worker.assign(0)
    req = request()
    await worker.handle(req, 0, 0)
    (job,) = worker.intake.jobs.values()
    assert job.head is not None
    await worker.assign()  # revoked at once: the job's task is cancelled before it ran a step
    await worker.settle()
    await pump()
    assert all(g.aborted for g in worker.engine.generations)


async def test_an_engine_that_refuses_a_head_start_fails_the_request_as_it_would_without_one() -> None:
    group = FakeGroup()
    worker = FakeWorker("w1", group)
    worker.engine.fail_with = ValueError("prompt too long")
    await worker.assign(0)
    req = request()
    claim = held(group)
    handling = asyncio.ensure_future(worker.handle(req, 0, 0))
    await pump()
    claim.set()
    await handling
    await worker.settle()
    _, stream = group.log.client_view(req.request_id)
    assert stream.final is not None and stream.final.error_code == "generation_failed"
    assert "prompt too long" in (stream.final.error or "")
