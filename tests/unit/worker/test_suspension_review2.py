"""Second adversarial review of the resume window, the worker's side (aca7d4d, 3da0641): a generation nobody is
attached to is suspended (out of the engine) and goes on from what it emitted when a client is back. Each test states
a defect the review found, its consequence for a user, an operator or a bill, and the code line (as of 45363b0). They
are strict xfails: each fails today for the reason it names, and turns the suite red (XPASS) once the defect is fixed,
when its marker is to be removed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import pytest
from prometheus_client import REGISTRY

from inference_workers.protocol import EngineDelta
from schemas.events import ORIGIN_ATTACHMENT, ChatRequest, ControlAction, ControlEvent, SamplingSpec, utcnow
from tests.fakes.engine import FakeEngine
from tests.fakes.kafka import FakeGroup
from tests.fakes.worker import FakeWorker, make, pump, request, until
from tests.helpers import in_virtual_time


def event(req: ChatRequest, action: ControlAction, attachment: str | None, gateway: str, *,
          delivered: int | None = None, window_s: float | None = None) -> ControlEvent:
    return ControlEvent(request_id=req.request_id, action=action, reason="test", issued_by=gateway,
                        issued_at=utcnow(), delivered_tokens=delivered, attachment=attachment, window_s=window_s)


def logged(group: FakeGroup, req: ChatRequest) -> int:
    """Completion tokens of the request the log holds (what its client can have)."""
    return group.log.client_view(req.request_id)[1].tokens


async def emitted(group: FakeGroup, req: ChatRequest, tokens: int) -> None:
    await until(lambda: logged(group, req) >= tokens, turns=10_000)


async def drop(worker: FakeWorker, group: FakeGroup, req: ChatRequest, attachment: str) -> None:
    """The client of ``attachment`` drops; the engine's next delta finds nobody attached: the generation suspends."""
    worker.intake.on_control(event(req, ControlAction.DETACH, attachment, "gw/a", delivered=logged(group, req),
                                   window_s=30))
    worker.engine.step(req.request_id, 1)
    await until(lambda: worker.intake.jobs[req.request_id].suspended, turns=10_000)


class SlowAbortEngine(FakeEngine):
    """The fake engine, with vLLM's abort: closing a generation's output awaits the engine core (an IPC round trip,
    ``AsyncLLM.abort``), here until the test lets it end."""

    def __init__(self) -> None:
        super().__init__(auto=False)
        self.closing = asyncio.Event()
        self.may_close = asyncio.Event()

    async def generate(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingSpec, *,
                       priority: int = 0) -> AsyncGenerator[EngineDelta, None]:
        inner = super().generate(request_id, prompt_token_ids, sampling, priority=priority)
        try:
            async for delta in inner:
                yield delta
        finally:
            await inner.aclose()
            self.closing.set()
            await self.may_close.wait()


async def test_a_client_back_while_the_engine_aborts_the_dropped_generation_gets_its_stream_going_on() -> None:
    """Defect: ``Intake._suspend`` (intake.py:593) creates the ``attended`` event and waits on it without looking at
    the connections. ``listeners_changed`` (intake.py:400-405) sets it only when it already exists, so an ATTACH that
    arrives between ``_relay_deltas`` returning None and ``_suspend`` (while ``aclosing`` awaits the engine's abort,
    intake.py:587: vLLM's abort is an IPC round trip, the head start's drop a task of its own) finds no event to set.
    Consequence: the resumed client gets no token although it is attached; only the next presence check
    (``worker.presence_check_s``, 1 s) wakes the job, and during a worker's drain (the presence loop is cancelled
    before ``Intake.drain``, worker.py:232) nothing does until the drain timeout. Fix: in ``_suspend``, set the event
    at once when ``job.listeners.live`` (or check it before waiting)."""
    group, engine = FakeGroup(), SlowAbortEngine()
    worker = make("w1", group, engine)
    await worker.assign(0)
    req = request(max_tokens=20, gateway="gw/a")
    await worker.handle(req, 0, 0)
    engine.step(req.request_id, 2)
    await emitted(group, req, 2)
    worker.intake.on_control(event(req, ControlAction.DETACH, ORIGIN_ATTACHMENT, "gw/a", delivered=2, window_s=30))
    engine.step(req.request_id, 1)  # found nobody attached: the generation is being aborted in the engine
    await until(engine.closing.is_set)
    worker.intake.on_control(event(req, ControlAction.ATTACH, "r1", "gw/a"))  # the client is back meanwhile
    engine.may_close.set()
    await pump(100)
    job = worker.intake.jobs[req.request_id]
    assert not (job.suspended and job.listeners.live), "suspended with its client attached"
    engine.step(req.request_id, 3)
    await emitted(group, req, 5)


@in_virtual_time
async def test_a_worker_stopping_does_not_wait_its_drain_timeout_for_a_generation_nobody_is_attached_to() -> None:
    """Defect: ``Intake.drain`` (intake.py:435) waits for every job's task, suspended ones included; a suspended job
    waits for a client (``_suspend``, intake.py:598) and its window cannot end meanwhile, since the worker cancels
    its presence loop before draining (worker.py:232). Consequence: any SIGTERM of a worker one of whose streams has
    a dropped client takes the whole ``worker.drain_timeout_s`` (20 s) however soon the rest ended, at every rolling
    deploy; then the job is aborted as "shutdown" all the same (its next owner takes it over and suspends it again).
    Fix: drain aborts suspended jobs at once (and a job that suspends while draining) as "shutdown", leaving them to
    the partition's next owner as it does at the timeout."""
    group = FakeGroup()
    worker = FakeWorker("w1", group, FakeEngine(auto=False))
    await worker.assign(0)
    req = request(max_tokens=20, gateway="gw/a")
    await worker.handle(req, 0, 0)
    worker.engine.step(req.request_id, 2)
    await emitted(group, req, 2)
    await drop(worker, group, req, ORIGIN_ATTACHMENT)
    loop = asyncio.get_running_loop()
    started = loop.time()
    await worker.intake.drain(timeout_s=20.0)
    assert loop.time() - started < 1.0, f"the drain took {loop.time() - started:.1f} s for a suspended job"


async def test_generations_resumed_after_the_worker_admitted_others_in_their_room_never_exceed_the_engine_batch(
) -> None:
    """Defect: ``Intake.capacity`` (intake.py:236) gives a suspended job's room to new admissions, and a job whose
    client is back re-enters the engine at once (``listeners_changed`` sets ``attended``, intake.py:404-406) whatever
    the room. Consequence: the engine holds more requests than ``max_num_seqs`` (the module's promise: "the worker
    never holds more requests than the engine batches"); the surplus waits in vLLM's own queue, outside the worker's
    priority classes and queue deadlines, and ``capacity()`` goes negative. The surplus is bounded by nothing on the
    worker: every stream dropped within its window (30 s) adds one (a client that drops and resumes its streams at
    will, within its key's concurrency, moves its generations ahead of the queue). Fix: a job resuming from a suspension
    waits for room (takes a slot back before re-entering the engine, ahead of new admissions), or suspended jobs keep
    counting against a bound of their own."""
    group, engine = FakeGroup(), FakeEngine(max_num_seqs=2, auto=False)
    worker = make("w1", group, engine)
    await worker.assign(0)
    dropped = [request(max_tokens=20, gateway="gw/a") for _ in range(2)]
    for offset, req in enumerate(dropped):
        await worker.handle(req, 0, offset)
        engine.step(req.request_id, 1)
        await emitted(group, req, 1)
    for req in dropped:
        await drop(worker, group, req, ORIGIN_ATTACHMENT)
    for offset, req in enumerate([request(max_tokens=20, gateway="gw/a") for _ in range(2)], start=2):
        if worker.intake.capacity() > 0:  # as the consumer loop asks before each fetch: their room is given away
            await worker.handle(req, 0, offset)
    for req in dropped:  # both clients come back
        worker.intake.on_control(event(req, ControlAction.ATTACH, "r1", "gw/a"))
    await pump(100)
    in_engine = [g for g in engine.generations if not g.aborted and not g.finished]
    assert len(in_engine) <= engine.max_num_seqs, f"{len(in_engine)} generations in an engine of 2"


async def test_each_resume_of_a_replay_mode_generation_replays_what_it_emitted_and_counts_it() -> None:
    """Review finding, answered (not closed): a replay-mode request (stop strings, a seed at temperature > 0,
    presence/frequency penalties: ``resume.needs_replay``) resumes from a suspension by regenerating what it emitted
    (checked and dropped: its sampler cannot continue from emitted tokens exactly; a stop string could straddle the
    boundary, and text the detokenizer held back would be lost). Each resume costs a decode of the output so far,
    unbilled: here 3 resumes of a 40-token answer decode 103 tokens for 40 billed. It is bounded by the key's reads
    per minute (a resume takes a read) and counted in ``kns_worker_replayed_tokens_total``, so it is visible; the
    answer stays exact."""
    group, engine = FakeGroup(), FakeEngine(auto=False)
    worker = make("w1", group, engine)
    await worker.assign(0)
    req = request(max_tokens=40, gateway="gw/a", stop=["<never>"])
    await worker.handle(req, 0, 0)
    replayed = REGISTRY.get_sample_value("kns_worker_replayed_tokens_total") or 0.0
    attachment = ORIGIN_ATTACHMENT
    for resume in range(3):
        while logged(group, req) < 10 * (resume + 1):  # the client reads 10 more tokens
            engine.step(req.request_id, 1)
            await pump()
        await drop(worker, group, req, attachment)
        attachment = f"r{resume}"
        worker.intake.on_control(event(req, ControlAction.ATTACH, attachment, "gw/a"))
    engine.step(req.request_id, 1000)
    await worker.settle()
    (usage,) = group.usage
    assert (usage.finish_reason, usage.completion_tokens, logged(group, req)) == ("length", 40, 40)
    decoded = sum(len(g.emitted) for g in engine.generations)
    # 40 emitted, the 10 + 20 + 30 replayed at the three resumes, and the one token in flight at each drop
    assert decoded == 40 + 60 + 3
    assert (REGISTRY.get_sample_value("kns_worker_replayed_tokens_total") or 0.0) - replayed == 60


async def test_a_takeover_after_many_resumes_still_knows_the_accepting_connection_detached() -> None:
    """Defect: ``RecentControls.remember`` (control.py:48-51) keeps the latest event of at most ``PER_REQUEST`` (64)
    connections per request and forgets the oldest first, and the oldest is the accepting connection's DETACH.
    ``Intake._listeners_of`` (intake.py:308) starts from ``Listeners.of(origin)``, where the origin is attached unless
    an event says otherwise. Consequence: after 64 resumes of one stream (a flaky mobile client over a long answer, or
    a client doing it on purpose within its reads per minute), a worker taking the stream over (a rebalance, a crash)
    counts the origin connection attached while its gateway lives: it generates to the end for nobody, never suspends,
    and bills everything (``received_cap`` is None while a connection is live). Fix: never forget the origin's entry
    (evict the oldest resume connection instead), or keep only connections still attached plus the latest detach."""
    group = FakeGroup()
    req = request(max_tokens=20, gateway="gw/a")
    w2 = make("w2", group, FakeEngine(auto=False))
    w2.intake.on_control(event(req, ControlAction.DETACH, ORIGIN_ATTACHMENT, "gw/a", delivered=0, window_s=30))
    for resume in range(64):
        w2.intake.on_control(event(req, ControlAction.ATTACH, f"r{resume}", "gw/a"))
        w2.intake.on_control(event(req, ControlAction.DETACH, f"r{resume}", "gw/a", delivered=0, window_s=30))
    await w2.assign(0)
    await w2.handle(req, 0, 0)
    assert not w2.intake.jobs[req.request_id].listeners.live


class GatedPrefixReader:
    """The log's read-back (``prefix.py``), held until the test lets it answer: a takeover reading a long stream, or
    reading it again while Kafka is away (``Intake._read_prefix`` retries for ``give_up_s``)."""

    def __init__(self, inner: object) -> None:
        self.inner = inner
        self.reading = asyncio.Event()
        self.answer = asyncio.Event()

    async def read(self, request: ChatRequest, first_offset: int | None) -> object:
        self.reading.set()
        await self.answer.wait()
        return await self.inner.read(request, first_offset)  # type: ignore[attr-defined]


class Redis:
    """The gateways' liveness keys (``mget``): every gateway alive."""

    async def mget(self, keys: list[str]) -> list[str | None]:
        return ["1"] * len(keys)


async def test_a_takeover_stopped_while_it_reads_the_log_back_is_billed_what_the_log_holds() -> None:
    """Defect: ``cancel_unattended`` (intake.py:415) and ``on_control`` (intake.py:397) fix ``job.received_cap`` from
    ``job.tokens`` at the moment of the stop; during a takeover's read-back (``_take_over``, shielded, intake.py:509)
    ``job.tokens`` is still 0, and ``_took_over`` (which sets it and the connections' ``seen_tokens``) runs only after.
    ``_finalize`` then bills that stale cap (intake.py:681). Consequence: a stream whose window ended while its worker
    died and its partition moved (the successor inherits the backdated unattended clock and its first presence check
    stops it) is billed what its client reported, not what the log holds for any client to read (here 4 of 6: the
    two in flight at the drop are free); a connection whose gateway died is billed 0 completion tokens for everything
    earlier attempts emitted (``Connection.billed`` gives ``seen_tokens``, still 0), the very case ``_took_over``'s
    ``took_over`` exists for. The same holds for a cancel remembered before admission (intake.py:293). Fix: decide
    the cap once the prefix is known (in ``_took_over`` when the job is already stopped, or keep "stopped unattended"
    and compute ``received_cap(job.tokens)`` in ``_finalize``)."""
    from datetime import timedelta

    from inference_workers.presence import GatewayPresence
    from runtime.settings import RedisSettings

    group = FakeGroup()
    w1 = make("w1", group, FakeEngine(auto=False))
    await w1.assign(0)
    req = request(max_tokens=20, gateway="gw/a")
    await w1.handle(req, 0, 0)
    w1.engine.step(req.request_id, 6)
    await emitted(group, req, 6)
    # The client read 4 and dropped 40 s ago, with a window of 30 s; its worker died before the window ended
    detach = event(req, ControlAction.DETACH, ORIGIN_ATTACHMENT, "gw/a", delivered=4, window_s=30)
    detach = detach.model_copy(update={"issued_at": utcnow() - timedelta(seconds=40)})
    w1.intake.on_control(detach)
    await w1.assign()
    w2 = make("w2", group, FakeEngine(auto=False))
    w2.intake.on_control(detach)
    reader = GatedPrefixReader(w2.intake._prefix)
    w2.intake._prefix = reader  # type: ignore[assignment]
    await w2.assign(0)
    await w2.handle(req.model_copy(deep=True), 0, 0)
    await until(reader.reading.is_set)
    presence = GatewayPresence(Redis(), RedisSettings(), w2.intake, check_every_s=1, grace_s=30)  # type: ignore[arg-type]
    await presence.check()  # the window ended: cancelled while the log is read back
    assert w2.intake.jobs[req.request_id].abort_cause == "unattended"
    reader.answer.set()
    await w2.settle()
    (usage,) = group.usage
    assert (usage.finish_reason, usage.completion_tokens, logged(group, req)) == ("cancelled", 6, 6)


async def test_a_request_whose_client_left_before_it_started_is_not_prefilled_until_a_client_is_back() -> None:
    """Defect: ``_admit`` gives a fresh request to the engine ahead of its claim (``_head_start``, intake.py:261)
    before it even builds the stream's connections (intake.py:287), and ``_generate_attended`` (intake.py:583) starts
    the engine without looking at them: only the first delta finds nobody attached (intake.py:613). The same for a
    takeover of a suspended stream, whose prefill is the prompt plus everything emitted. Consequence: a prefill and a
    decode step for nobody, and an engine slot taken meanwhile, for every request whose client dropped while it waited
    in the backlog and for every suspended stream at each rebalance or rolling deploy (the successor re-prefills each,
    then suspends it): the module's "nothing is generated for nobody but what was in flight" does not hold. Fix: no
    head start and no engine call while ``job.listeners.live`` is false and the request is not a background one;
    suspend first."""
    group, engine = FakeGroup(), FakeEngine(auto=False)
    worker = make("w1", group, engine)
    req = request(max_tokens=20, gateway="gw/a")
    # Its client dropped while it waited in the backlog (nothing received), within its window
    worker.intake.on_control(event(req, ControlAction.DETACH, ORIGIN_ATTACHMENT, "gw/a", delivered=0, window_s=30))
    await worker.assign(0)
    await worker.handle(req, 0, 0)
    await pump(100)
    assert engine.generations == [], f"{len(engine.generations)} generation(s) given to the engine for nobody"
    worker.intake.on_control(event(req, ControlAction.ATTACH, "r1", "gw/a"))  # back: now it is generated
    engine.step(req.request_id, 3)
    await emitted(group, req, 3)


class PerfClock:
    """``time`` as the intake reads it, with ``perf_counter`` moved by the test (the rest is the real module)."""

    def __init__(self) -> None:
        import time as real

        self._real = real
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now

    def __getattr__(self, name: str) -> object:
        return getattr(self._real, name)


async def test_the_time_to_first_token_of_a_stream_suspended_before_its_first_token_leaves_the_suspension_out(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Defect: ``kns_worker_ttft_seconds`` is observed at this attempt's first emission as ``perf_counter() -
    job.admitted_at`` (intake.py:621-622); a stream suspended before its first token (its client dropped while it was
    prefilled) emits it only once a client is back, up to its whole window later (30 s, a tier's more), and that wait
    is counted as the engine's. Consequence: the worker's TTFT histogram, which the docs and dashboards read as queue
    plus prefill, gets a tail of client absences (one dropped client makes a 30 s "TTFT"), hiding or faking an engine
    slowdown. Fix: observe TTFT only for a first token not preceded by a suspension (or from the resume's start), and
    count the suspension apart."""
    from prometheus_client import REGISTRY

    import inference_workers.intake as intake_module

    clock = PerfClock()
    monkeypatch.setattr(intake_module, "time", clock)
    group, engine = FakeGroup(), FakeEngine(auto=False)
    worker = make("w1", group, engine)
    await worker.assign(0)
    req = request(max_tokens=20, gateway="gw/a")
    before = REGISTRY.get_sample_value("kns_worker_ttft_seconds_sum") or 0.0
    await worker.handle(req, 0, 0)
    clock.now += 0.2  # prefilled in 200 ms; its client left meanwhile
    await drop(worker, group, req, ORIGIN_ATTACHMENT)
    clock.now += 25.0  # back 25 s later
    worker.intake.on_control(event(req, ControlAction.ATTACH, "r1", "gw/a"))
    engine.step(req.request_id, 1)
    await emitted(group, req, 1)
    observed = (REGISTRY.get_sample_value("kns_worker_ttft_seconds_sum") or 0.0) - before
    assert observed < 1.0, f"a TTFT of {observed:.1f} s observed"
