"""Issues 10, 36 and 37: a stream goes on while some client connection is attached to it (its accepting gateway's,
or a resume's on any gateway), and for the resume window after the last one left; then it is cancelled, billed by
the rule of ``inference_workers/listeners.py``. While nobody is attached, its output is held by the worker: a client
back within the window gets it, one that never comes back never finds it in the log, and is not billed for it."""

from __future__ import annotations

import asyncio

from inference_workers.presence import GatewayPresence
from inference_workers.synthetic import expected_completion
from runtime.settings import RedisSettings
from schemas.events import ORIGIN_ATTACHMENT, ChatRequest, ControlAction, ControlEvent, utcnow
from tests.fakes.engine import FakeEngine
from tests.fakes.kafka import FakeGroup
from tests.fakes.worker import FakeWorker, request


class Redis:
    """The gateways' liveness keys (``mget``)."""

    def __init__(self, *alive: str) -> None:
        self.alive = set(alive)

    async def mget(self, keys: list[str]) -> list[str | None]:
        return ["1" if k.endswith(tuple(self.alive)) else None for k in keys]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def pump() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


async def until(predicate: object, turns: int = 10_000) -> None:
    for _ in range(turns):
        if predicate():  # type: ignore[operator]
            return
        await asyncio.sleep(0)
    raise AssertionError("the condition never held")


async def emitted(group: FakeGroup, req: ChatRequest, tokens: int) -> None:
    """Until the log holds ``tokens`` of the request (what its client can have)."""
    for _ in range(10_000):
        if group.log.client_view(req.request_id)[1].tokens >= tokens:
            return
        await asyncio.sleep(0)
    raise AssertionError(f"the log never held {tokens} tokens of {req.request_id}")


def event(req: ChatRequest, action: ControlAction, attachment: str | None, gateway: str, *,
          delivered: int | None = None, window_s: float | None = None) -> ControlEvent:
    return ControlEvent(request_id=req.request_id, action=action, reason="test", issued_by=gateway,
                        issued_at=utcnow(), delivered_tokens=delivered, attachment=attachment, window_s=window_s)


async def generating(gateway: str = "gw/a", *, grace_s: float = 30.0, alive: tuple[str, ...] = ("gw/a",),
                     max_tokens: int = 100) -> tuple[FakeGroup, FakeWorker, ChatRequest, GatewayPresence, Redis, Clock]:
    group, clock = FakeGroup(), Clock()
    worker = FakeWorker("w1", group, FakeEngine(auto=False))
    worker.intake.clock = clock
    await worker.assign(0)
    req = request(max_tokens=max_tokens, gateway=gateway)
    await worker.handle(req, 0, 0)
    redis = Redis(*alive)
    presence = GatewayPresence(redis, RedisSettings(), worker.intake, check_every_s=1,  # type: ignore[arg-type]
                               grace_s=grace_s, clock=clock)
    return group, worker, req, presence, redis, clock


async def test_a_stream_resumed_elsewhere_goes_on_while_the_resumer_lives_and_bills_what_it_relayed() -> None:
    group, worker, req, presence, redis, clock = await generating(grace_s=10)
    worker.engine.step(req.request_id, 2)
    await emitted(group, req, 2)
    await presence.check()
    redis.alive = {"gw/b"}  # its gateway died; another one resumed the stream
    worker.intake.on_control(event(req, ControlAction.ATTACH, "r1", "gw/b"))
    worker.engine.step(req.request_id, 3)
    await emitted(group, req, 5)
    clock.now += 60
    await presence.check()
    assert worker.intake.jobs[req.request_id].abort_cause is None  # relayed by the resumer: generation goes on
    redis.alive = set()  # the resumer dies too, and nobody resumes it again
    await presence.check()
    worker.engine.step(req.request_id, 4)  # held: nobody attached any more
    await pump()
    clock.now += 10
    await presence.check()
    await worker.settle()
    (usage,) = group.usage
    _, stream = group.log.client_view(req.request_id)
    assert (usage.finish_reason, usage.completion_tokens, stream.tokens) == ("cancelled", 5, 5)


async def test_a_stream_with_no_client_waits_out_its_window_on_the_clock_then_is_cancelled() -> None:
    group, worker, req, presence, redis, clock = await generating(grace_s=30)
    worker.engine.step(req.request_id, 3)
    await pump()
    await presence.check()  # its gateway relays it: 3 tokens out
    redis.alive = set()  # the gateway dies
    await presence.check()
    clock.now += 29.9
    await presence.check()
    assert worker.intake.jobs[req.request_id].abort_cause is None  # still within its window
    clock.now += 0.1
    await presence.check()
    await worker.settle()
    (usage,) = group.usage
    assert (usage.finish_reason, usage.completion_tokens) == ("cancelled", 3)


async def test_a_non_streamed_stored_completion_is_generated_to_its_end_and_billed_whole_when_its_gateway_dies(
        ) -> None:
    """Its client cannot resume it (nothing was streamed, it has no id): it reads the stored row, which must be whole.
    A streamed one is suspended when its gateway dies, for its client to resume within the window."""
    group, clock = FakeGroup(), Clock()
    worker = FakeWorker("w1", group, FakeEngine(auto=False))
    worker.intake.clock = clock
    await worker.assign(0)
    stored = request(max_tokens=8, gateway="gw/a").model_copy(update={"stream": False, "store": True})
    streamed = request(max_tokens=8, gateway="gw/a")
    for offset, req in enumerate((stored, streamed)):
        await worker.handle(req, 0, offset)
    redis = Redis("gw/a")
    presence = GatewayPresence(redis, RedisSettings(), worker.intake, check_every_s=1,  # type: ignore[arg-type]
                               grace_s=30, clock=clock)
    for req in (stored, streamed):
        worker.engine.step(req.request_id, 3)
    await emitted(group, stored, 3)
    await presence.check()
    redis.alive = set()  # the gateway dies before it could answer
    await presence.check()
    clock.now += 60
    await presence.check()  # past the window
    worker.engine.step(stored.request_id, 5)
    await worker.settle()
    usage = {u.request_id: u for u in group.usage}
    assert (usage[stored.request_id].finish_reason, usage[stored.request_id].completion_tokens) == ("length", 8)
    assert (usage[streamed.request_id].finish_reason, usage[streamed.request_id].completion_tokens) == ("cancelled", 3)


async def test_a_dropped_client_back_within_its_window_gets_every_token_once_in_order() -> None:
    group, worker, req, presence, _redis, clock = await generating(max_tokens=10)
    worker.engine.step(req.request_id, 4)
    await emitted(group, req, 4)
    worker.intake.on_control(event(req, ControlAction.DETACH, ORIGIN_ATTACHMENT, "gw/a", delivered=4, window_s=30))
    worker.engine.step(req.request_id, 1)  # generated while nobody listens: not emitted, the generation suspended
    await until(lambda: worker.intake.jobs[req.request_id].suspended)
    assert worker.intake.capacity() == worker.intake._max  # out of the engine's batch meanwhile
    clock.now += 10
    await presence.check()
    assert group.log.client_view(req.request_id)[1].tokens == 4
    worker.intake.on_control(event(req, ControlAction.ATTACH, "r1", "gw/a"))  # back, on the same gateway
    clock.now += 60
    await presence.check()
    assert worker.intake.jobs[req.request_id].abort_cause is None  # attached again: no window runs
    worker.engine.step(req.request_id, 6)  # it goes on from the log's end: one prefill of prompt + 4 tokens
    await worker.settle()
    (usage,) = group.usage
    text, stream = group.log.client_view(req.request_id)
    assert stream.error is None and stream.tokens == usage.completion_tokens == 10
    assert text == expected_completion(req.prompt_token_ids, req.sampling)[1]
    assert [g.prompt[len(req.prompt_token_ids):] for g in worker.engine.served()][-1] == [
        int(t) for t in expected_completion(req.prompt_token_ids, req.sampling)[0][:4]]


async def test_a_dropped_client_that_never_returns_is_cancelled_at_the_windows_end_billed_what_the_log_holds(
) -> None:
    """Nothing is generated for nobody but what was in flight when the worker heard of the drop (here one token the
    client had not read yet); what the log holds is what any client of the stream can still read, and is billed."""
    group, worker, req, presence, _redis, clock = await generating(grace_s=600)
    worker.engine.step(req.request_id, 4)
    await emitted(group, req, 4)
    worker.intake.on_control(event(req, ControlAction.DETACH, ORIGIN_ATTACHMENT, "gw/a", delivered=3, window_s=5))
    worker.engine.step(req.request_id, 20)
    await until(lambda: worker.intake.jobs[req.request_id].suspended)
    clock.now += 4.9
    await presence.check()
    assert worker.intake.jobs[req.request_id].abort_cause is None
    clock.now += 0.1  # the detaching client's window, not the worker's grace
    await presence.check()
    await worker.settle()
    (usage,) = group.usage
    _, stream = group.log.client_view(req.request_id)
    assert (usage.finish_reason, usage.completion_tokens, stream.tokens) == ("cancelled", 4, 4)
    assert len(worker.engine.served()) == 1  # suspended after the drop: no second generation for nobody


async def test_a_resume_dropped_at_once_on_another_gateway_does_not_lower_the_bill() -> None:
    """Issue 37 C1: the stream is read on gateway A; a resume on gateway B attaches and hangs up at once (its
    connection received nothing). A keeps every token, so the bill does too, whatever B's connection reported."""
    group, worker, req, _presence, _redis, _clock = await generating(alive=("gw/a", "gw/b"))
    worker.engine.step(req.request_id, 30)
    await emitted(group, req, 30)
    worker.intake.on_control(event(req, ControlAction.ATTACH, "r1", "gw/b"))
    worker.intake.on_control(event(req, ControlAction.CANCEL, "r1", "gw/b", delivered=0))  # a window of 0: cancel
    await worker.settle()
    (usage,) = group.usage
    _, stream = group.log.client_view(req.request_id)
    assert usage.completion_tokens == stream.tokens == 30


async def test_an_explicit_cancel_while_a_client_reads_bills_everything_that_client_gets() -> None:
    group, worker, req, _presence, _redis, _clock = await generating()
    worker.engine.step(req.request_id, 7)
    await emitted(group, req, 7)
    worker.intake.on_control(event(req, ControlAction.CANCEL, None, "gw/b"))  # POST .../cancel on any gateway
    await worker.settle()
    (usage,) = group.usage
    _, stream = group.log.client_view(req.request_id)
    assert (usage.finish_reason, usage.completion_tokens, stream.tokens) == ("cancelled", 7, 7)


async def test_a_takeover_inherits_a_detached_client_and_its_window() -> None:
    """The worker dies during a dropped client's window; its successor learns from the control topic that nobody
    is attached (and since when), holds its output, and cancels when the window ends, billed the report."""
    group, worker, req, _presence, redis, clock = await generating()
    worker.engine.step(req.request_id, 4)
    await pump()
    worker.intake.on_control(event(req, ControlAction.DETACH, ORIGIN_ATTACHMENT, "gw/a", delivered=4, window_s=5))
    await worker.assign()  # w1 dies
    w2 = FakeWorker("w2", group, FakeEngine(auto=False))
    w2.intake.clock = clock
    w2.intake.on_control(event(req, ControlAction.DETACH, ORIGIN_ATTACHMENT, "gw/a", delivered=4, window_s=5))
    await w2.assign(0)
    await w2.handle(req.model_copy(deep=True), 0, 0)
    await pump()
    assert w2.intake.jobs[req.request_id].tokens == 4 and not w2.intake.jobs[req.request_id].listeners.live
    w2.engine.step(req.request_id, 3)
    await pump()
    assert group.log.client_view(req.request_id)[1].tokens == 4  # held
    second = GatewayPresence(redis, RedisSettings(), w2.intake, check_every_s=1,  # type: ignore[arg-type]
                             grace_s=600, clock=clock)
    clock.now += 5
    await second.check()
    await w2.settle()
    (usage,) = group.usage
    assert (usage.finish_reason, usage.completion_tokens) == ("cancelled", 4)


async def test_a_prompt_the_engine_processed_is_billed_though_cancelled_before_its_first_token() -> None:
    """Issue 37 L3: a prefill costs GPU work, so a generation cancelled before its first token is billed its prompt
    (a loop of large prompts cancelled at once was free); one cancelled while it waited in the queue never ran and is
    not billed."""
    group, worker, req, _presence, _redis, _clock = await generating()
    await pump()  # generating: the engine has its prompt
    worker.intake.on_control(event(req, ControlAction.CANCEL, None, "gw/a"))
    queued = request(max_tokens=10, gateway="gw/a")
    worker.intake.on_control(event(queued, ControlAction.CANCEL, None, "gw/a"))  # before it reached the worker
    await worker.handle(queued, 0, 1)
    await worker.settle()
    assert [(u.request_id, u.prompt_tokens, u.completion_tokens) for u in group.usage] == [
        (req.request_id, len(req.prompt_token_ids), 0)]
