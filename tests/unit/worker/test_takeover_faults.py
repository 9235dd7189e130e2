"""Takeovers under faults (fakes drive the real Intake / OffsetTracker / rebalance listener), from an adversarial
review: each test failed on the first version of the takeover code for the reason in its docstring. Promises:
  (1) a client never receives text that no single generation produced; a stream that cannot continue exactly
      ends with a clear error;
  (2) every token is billed exactly once: prompt once, completion = the tokens the client received.
"""

from __future__ import annotations

import asyncio

from aiokafka import TopicPartition

from inference_workers.resume import EmittedPrefix
from schemas.errors import FatalError
from schemas.events import ChatRequest, ControlAction, ControlEvent, utcnow
from tests.fakes.engine import FakeEngine
from tests.fakes.kafka import FakeGroup
from tests.fakes.worker import TOPIC, FakeWorker, make, pump, request

P0 = TopicPartition(TOPIC, 0)


def copy(req: ChatRequest) -> ChatRequest:
    """Another process decodes its own copy of the record (the synthetic sampler's unseeded stream is per object,
    as a real sampler's RNG is per generation)."""
    return req.model_copy(deep=True)


def control(req: ChatRequest, action: ControlAction = ControlAction.CANCEL,
            delivered: int | None = None) -> ControlEvent:
    """A cancel as the gateway sends it (with what its client received), or a halt (the post-filter's)."""
    return ControlEvent(request_id=req.request_id, action=action, reason="review", issued_by="gw",
                        issued_at=utcnow(), delivered_tokens=delivered)


async def test_a_restart_after_redis_lost_the_claim_never_splices_two_samples() -> None:
    """Promise 1, silent splice. Redis runs without persistence (restart-redis). A request was admitted and
    streamed 3 tokens by w1 after the partition's last commit (so the commit's metadata does not list it as
    open: only the claim knew it had started). Redis restarts (claims gone), then w1 dies / its partition moves.
    w2 re-fetches the record: offsets say NEW (not inherited), the claim says START attempt 1 -> no takeover:
    it generates from scratch as *attempt 1, seq 0*. The relay's merge drops w2's seq 0..2 as duplicates of
    w1's and accepts seq 3.. at token_offset 3 == tokens it has: the client's text is w1's sample for tokens
    0..2 followed by w2's (different, unseeded temperature>0) sample, with no error.
    (intake.py:219-222 takeover only on claim.attempt>1 or inherited; token_stream.py:65-67 seq dedup.)"""
    group = FakeGroup()
    w1, w2 = make("w1", group, FakeEngine(auto=False)), make("w2", group)
    await w1.assign(0)
    req = request(max_tokens=8, temperature=0.8)
    await w1.handle(req, 0, 0)
    w1.engine.step(req.request_id, 3)
    await pump()
    assert group.committed == {}  # nothing committed on the partition since the request was admitted

    group.claims.claims.clear()  # Redis restarted without persistence
    await w1.assign()  # w1 dies (or its partition moves): its attempt is not committed
    await w2.assign(0)
    await w2.handle(copy(req), 0, 0)
    await w2.settle()

    _, stream = group.log.client_view(req.request_id)
    w1_tokens = w1.engine.generation(req.request_id).emitted
    w2_tokens = w2.engine.generation(req.request_id).emitted
    assert w1_tokens[:3] != w2_tokens[:3]  # two different samples
    # what the client got must be one generation's text: all of it, or a prefix ended by an error
    got = list(stream.token_ids)
    assert stream.final is not None or stream.error is not None, f"the stream never ends (got {got})"
    assert any(got == tokens[:len(got)] for tokens in (w1_tokens, w2_tokens)), (
        f"the client received tokens no single generation produced: {got}")
    assert stream.error is not None or got == w2_tokens, f"ended without an error, incomplete: {got}"


async def test_zombie_deltas_after_a_takeovers_prefix_read_are_billed_as_the_client_received_them(
) -> None:
    """Promise 2. w1 stalls (GC, SIGSTOP, network) longer than the session timeout; the group gives its
    partition to w2, whose producer fences w1's *transactions* - but w1's deltas go through the idempotent,
    non-transactional producer and are not fenced. w2 reads the prefix (3 tokens) and starts attempt 2; before
    attempt 2's first event lands, w1 wakes and emits tokens 3 and 4 (attempt 1): the relay accepts them.
    Attempt 2's first event (token_offset 3) then diverges -> the relay ends the stream (stream_inconsistent)
    and the gateway cancels. The client received 5 tokens; w2 bills prefix(3) + what *it* emitted, never 5.
    (prefix.py:68 reads to the end offset at scan time; intake.py:455 completion = job.tokens.)"""
    group = FakeGroup()
    w1, w2 = make("w1", group, FakeEngine(auto=False)), make("w2", group, FakeEngine(auto=False))
    await w1.assign(0)
    req = request(max_tokens=20, temperature=0.8)
    await w1.handle(req, 0, 0)
    w1.engine.step(req.request_id, 3)
    await pump()

    await w2.assign(0)  # w1 missed this rebalance (stalled): it still generates
    await w2.handle(copy(req), 0, 0)
    await pump()
    assert w2.prefix.reads == 1
    w1.engine.step(req.request_id, 2)  # the zombie's buffered output lands after w2's prefix read
    await pump()
    w2.engine.step(req.request_id, 1)  # attempt 2's first token
    await pump()
    _, stream = group.log.client_view(req.request_id)
    received = stream.tokens
    assert received == 5 and stream.error is not None  # the stream ended in error: good

    w2.intake.on_control(control(req, delivered=received))  # the gateway cancels the inconsistent stream
    await w1.assign()  # w1 learns it lost the partition: aborted, not committed
    await w2.settle()
    (usage,) = group.usage
    assert usage.completion_tokens == received, (
        f"billed {usage.completion_tokens} completion tokens, the client received {received}")


class HeldPrefixReader:
    """The real reader's seam, with the read held until the test releases it (a takeover's partition scan)."""

    def __init__(self, inner: object, *, fail: BaseException | None = None) -> None:
        self.inner = inner
        self.release = asyncio.Event()
        self.started = asyncio.Event()
        self.fail = fail
        self.reads = 0

    async def read(self, req: ChatRequest, first_offset: int | None) -> EmittedPrefix:
        self.reads += 1
        self.started.set()
        await self.release.wait()
        if self.fail is not None:
            raise self.fail
        return await self.inner.read(req, first_offset)  # type: ignore[attr-defined]


async def _takeover_in_prefix_read(fail: BaseException | None = None
                                   ) -> tuple[FakeGroup, FakeWorker, FakeWorker, ChatRequest, HeldPrefixReader]:
    group = FakeGroup()
    w1, w2 = make("w1", group, FakeEngine(auto=False)), make("w2", group, FakeEngine(auto=False))
    held = HeldPrefixReader(w2.prefix, fail=fail)
    w2.intake._prefix = held  # type: ignore[assignment]
    await w1.assign(0)
    req = request(max_tokens=20)
    await w1.handle(req, 0, 0)
    w1.engine.step(req.request_id, 4)
    await pump()
    await w1.assign()  # w1's partition moves (or w1 is killed): 4 tokens are with the client
    await w2.assign(0)
    await w2.handle(copy(req), 0, 0)
    await held.started.wait()
    return group, w1, w2, req, held


async def test_a_cancel_during_a_takeovers_prefix_read_bills_what_the_client_received(
) -> None:
    """Promise 2. The client received 4 tokens from attempt 1, then hangs up while attempt 2 is reading the
    prefix (a partition scan; up to 30 s, serialised over all takeovers by one lock). The CANCEL cancels the
    task inside ``await self._prefix.read`` (intake.py:372), before ``job.tokens``/``job.ran`` are set
    (intake.py:376): _finalize sees completion 0, ran False -> billed False -> no usage event at all.
    (The existing test only covers a cancel that arrived *before* admission.)"""
    group, _, w2, req, held = await _takeover_in_prefix_read()
    w2.intake.on_control(control(req, delivered=4))
    held.release.set()
    await w2.settle()
    _, stream = group.log.client_view(req.request_id)
    assert stream.tokens == 4
    assert [(u.prompt_tokens, u.completion_tokens) for u in group.usage] == [(4, 4)], (
        f"usage committed: {[(u.prompt_tokens, u.completion_tokens) for u in group.usage]}")


async def test_a_halt_during_a_takeovers_prefix_read_reaches_the_client_as_content_filter(
) -> None:
    """Promise 1 (wrong error) and 2. The safety post-filter HALTs a request whose takeover is reading its
    prefix. The final is written with token_offset 0 (job.tokens never set), attempt 2: the relay's merge finds
    a newer attempt 'finishing at token 0 before the 4 tokens already sent' -> the client gets
    stream_inconsistent (502) instead of content_filter, and nothing is billed."""
    group, _, w2, req, held = await _takeover_in_prefix_read()
    w2.intake.on_control(control(req, ControlAction.HALT))
    held.release.set()
    await w2.settle()
    _, stream = group.log.client_view(req.request_id)
    assert stream.final is not None and stream.final.finish_reason == "content_filter", (
        f"client saw error={stream.error!r}")


async def test_a_takeover_whose_prefix_read_fails_commits_nothing_and_the_next_one_bills_what_was_received(
) -> None:
    """Promise 2. The prefix read keeps failing (a broker restart: the moment workers die and partitions move).
    Without it neither what to generate nor what to bill is known, so nothing is committed (no unbilled error
    final): the worker stops (its supervisor restarts it) and the partition's next owner reads it again, and
    bills the 4 tokens the client received, prompt included."""
    group, _, w2, req, held = await _takeover_in_prefix_read(fail=TimeoutError())
    held.release.set()
    await w2.settle()
    assert group.usage == [] and w2.intake.fatal.done()
    assert isinstance(w2.intake.fatal.exception(), FatalError)
    _, stream = group.log.client_view(req.request_id)
    assert stream.tokens == 4 and stream.final is None and stream.error is None

    await w2.assign()  # the stopped worker leaves the group
    w3 = make("w3", group)
    await w3.assign(0)
    await w3.handle(copy(req), 0, 0)
    await w3.settle()
    (usage,) = group.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (4, 20)
    _, stream = group.log.client_view(req.request_id)
    assert stream.final is not None and stream.error is None
