"""Adversarial review of 86f95a9 (issue 36 item 1, issue 37 C1), the worker's side: output held while no client
connection is attached, the billing rule of ``inference_workers/listeners.py`` and what a takeover inherits from the
control topic. Each xfail test states a defect, its consequence for a user or a bill, and the code line (line
numbers as of 86f95a9); it fails on 86f95a9 for that reason."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import REGISTRY
from redis.exceptions import ConnectionError as RedisConnectionError

from inference_workers.control import RecentControls
from inference_workers.presence import GatewayPresence
from runtime.settings import RedisSettings, SafetySettings
from schemas.events import ORIGIN_ATTACHMENT, ChatRequest, ControlAction, ControlEvent, TokenEvent, utcnow
from stream_processors.safety.policy import OutputWindow
from tests.fakes.engine import FakeEngine
from tests.fakes.kafka import FakeGroup
from tests.fakes.worker import FakeWorker, make, request


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
    worker = make("w1", group, FakeEngine(auto=False))  # stopped after the test (tests/unit/worker/conftest.py)
    worker.intake.clock = clock
    await worker.assign(0)
    req = request(max_tokens=max_tokens, gateway=gateway)
    await worker.handle(req, 0, 0)
    redis = Redis(*alive)
    presence = GatewayPresence(redis, RedisSettings(), worker.intake, check_every_s=1,  # type: ignore[arg-type]
                               grace_s=grace_s, clock=clock)
    return group, worker, req, presence, redis, clock


def unscreened(events: list[TokenEvent]) -> int:
    """Characters of the output the safety post-filter never classifies, fed the request's token events in log order
    with its default stride and window (``stream_processors/safety/processor.py`` ``screen_output``)."""
    safety = SafetySettings()
    window = OutputWindow(safety.post_stride_tokens, safety.post_window_chars)
    covered: set[int] = set()
    length = 0
    for token in events:
        length += len(token.text)
        if window.add(token):
            covered.update(range(max(0, length - safety.post_window_chars), length))
    return length - len(covered)


def counter(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


# --- safety: held output reaches the client past the post-filter ----------------------------------------------------


async def test_a_stream_read_throughout_is_screened_in_every_character_by_the_post_filter() -> None:
    """The yardstick of the next test: one delta per engine step, every character falls in a classified window."""
    group, worker, req, _presence, _redis, _clock = await generating(max_tokens=120)
    worker.engine.step(req.request_id, 120)
    await worker.settle()
    tokens, missing = group.log.client_view(req.request_id)[1].tokens, unscreened(group.log.events(req.request_id))
    assert (tokens, missing) == (120, 0)


@pytest.mark.xfail(strict=True, reason="review: held output is released as one burst the post-filter cannot screen")
async def test_output_held_for_a_dropped_client_is_screened_by_the_post_filter_like_any_output() -> None:
    """Defect: while nobody is attached the worker holds the engine's output and releases it *as one delta* when a
    client comes back (``intake.py`` ``_unhold``, called at line 581; or in the final, line 573). The post-filter
    classifies only the last ``post_window_chars`` (320) of each event's text every ``post_stride_tokens``
    (``stream_processors/safety/policy.py`` ``OutputWindow.add``), and never halts on a final. So everything
    generated during the drop but its last 320 characters is never screened, and the rest reaches the client at once.

    Consequence: a safety-control bypass any client can trigger: open a stream, drop the connection at once, resume
    within the window (or after the answer ended, within the 15 min resume TTL): the whole answer arrives unscreened
    (before 86f95a9 the post-filter halted within 64 tokens)."""
    group, worker, req, _presence, _redis, _clock = await generating(max_tokens=120)
    worker.engine.step(req.request_id, 2)
    await emitted(group, req, 2)
    worker.intake.on_control(event(req, ControlAction.DETACH, ORIGIN_ATTACHMENT, "gw/a", delivered=2, window_s=30))
    worker.engine.step(req.request_id, 100)  # held: nobody attached
    await pump()
    worker.intake.on_control(event(req, ControlAction.ATTACH, "r1", "gw/b"))  # the client is back
    worker.engine.step(req.request_id, 18)
    await worker.settle()
    tokens, missing = group.log.client_view(req.request_id)[1].tokens, unscreened(group.log.events(req.request_id))
    assert (tokens, missing) == (120, 0)


# --- billing: an abandoned stream billed in full ---------------------------------------------------------------------


@pytest.mark.xfail(strict=True, reason="review: an abandoned stream that ends within its window is billed in full")
async def test_an_abandoned_stream_that_ends_within_its_window_is_billed_what_its_client_received() -> None:
    """Defect: a generation that ends while nobody is attached emits everything it held in its final and is billed
    whole (``intake.py`` lines 571-574, "A finished answer is emitted whole, held output included ... and is
    billed"), though no client came back. 86f95a9 says held output is "never billed nor in the log if nobody comes
    back within the window", and ``kns chaos drop-clients`` (3489e24) expects abandoned streams "billed what they
    received"; it only passes because its knobs make every answer outlast the 1 s window.

    Consequence: billing beyond delivery in the common case: a client that drops and gives up is billed its whole
    answer whenever that answer ends within the window (30 s by default: most answers), the same client dropping
    from a longer answer only what it received."""
    group, worker, req, presence, _redis, clock = await generating(max_tokens=10)
    worker.engine.step(req.request_id, 3)
    await emitted(group, req, 3)
    worker.intake.on_control(event(req, ControlAction.DETACH, ORIGIN_ATTACHMENT, "gw/a", delivered=3, window_s=30))
    worker.engine.step(req.request_id, 7)  # the answer ends 2 s later, nobody attached
    await pump()
    clock.now += 30  # nobody comes back within the window
    await presence.check()
    await worker.settle()
    billed = [u.completion_tokens for u in group.usage]
    assert billed == [3]


# --- free tokens: in the log, resumable, not billed ------------------------------------------------------------------


@pytest.mark.xfail(strict=True, reason="review: tokens emitted before the detach reached the worker are free")
async def test_every_token_a_late_resume_can_read_is_billed_when_a_dropped_client_never_returns() -> None:
    """Defect: the worker emits while it still counts the dropped connection as attached: until its DETACH has gone
    through the control topic (a lagging topic: seconds). On the window's cancel it bills the connection's report
    (``listeners.py`` line 124 via ``Connection.received``, line 47), not what is in the log; the log keeps those
    tokens, and the stream record lives ``resume_ttl_s`` (900 s), far past the window.

    Consequence: free tokens: a client that resumes after the window's cancel (the resume is still answered, from the
    log) receives tokens nobody is billed for, as many as the worker emitted during the DETACH's lag. (The existing
    ``test_a_dropped_client_that_never_returns_...`` asserts exactly this gap: billed 3, log 4.)"""
    group, worker, req, presence, _redis, clock = await generating()
    worker.engine.step(req.request_id, 12)
    await emitted(group, req, 12)  # the client's gateway had relayed 4 when it dropped; the DETACH lagged
    worker.intake.on_control(event(req, ControlAction.DETACH, ORIGIN_ATTACHMENT, "gw/a", delivered=4, window_s=5))
    clock.now += 5
    await presence.check()
    await worker.settle()
    billed = [u.completion_tokens for u in group.usage]
    in_log = group.log.client_view(req.request_id)[1].tokens  # what a resume within the resume TTL replays
    assert (in_log, billed) == (12, [12])


@pytest.mark.xfail(strict=True, reason="review: tokens emitted after a gateway's last live check are free")
async def test_every_token_a_late_resume_can_read_is_billed_when_a_dead_gateways_client_never_returns() -> None:
    """Defect: a connection whose gateway died is billed what was emitted "when that gateway was last seen alive"
    (``listeners.py`` ``Connection.seen_tokens``, set at line 96 only while the liveness key exists); the worker
    goes on emitting to the log until the check that finds the key gone (``presence_check_s`` later, plus a
    takeover's first check: a successor assumes every inherited connection alive, line 37, until it looks).

    Consequence: free tokens: the client resumes after the window's cancel, within the resume TTL, and reads from
    the log tokens never billed (the L2 finding of the security review, narrowed to one check interval, not
    closed)."""
    group, worker, req, presence, redis, clock = await generating(grace_s=30)
    worker.engine.step(req.request_id, 3)
    await emitted(group, req, 3)
    await presence.check()  # alive: 3 out
    worker.engine.step(req.request_id, 5)
    await emitted(group, req, 8)  # the gateway dies meanwhile; its liveness key lapses before the next check
    redis.alive = set()
    await presence.check()
    clock.now += 30
    await presence.check()
    await worker.settle()
    billed = [u.completion_tokens for u in group.usage]
    in_log = group.log.client_view(req.request_id)[1].tokens
    assert (in_log, billed) == (8, [8])


# --- Redis away: the windows that need no Redis stop running ---------------------------------------------------------


class RedisAway:
    async def mget(self, keys: list[str]) -> list[str | None]:
        raise RedisConnectionError("Redis is restarting")


@pytest.mark.xfail(strict=True, reason="review: while Redis is away no dropped stream's window ends")
async def test_a_dropped_clients_window_ends_while_redis_is_away() -> None:
    """Defect: the presence check returns before looking at any stream when the liveness lookup fails
    (``presence.py`` lines 56-59, "unknown is not gone"), though a stream whose every connection *detached* needs no
    liveness key to know nobody is attached: its window runs on the worker's own clock. With any other stream attached
    on the worker (every busy worker) the lookup is made, fails, and no window ends.

    Consequence: during a Redis outage every dropped stream is generated to ``max_tokens`` for nobody, and (an answer
    that ends is emitted whole and billed) billed in full; the resume window no longer bounds the work."""
    group, worker, _attached, _presence, _redis, clock = await generating()
    dropped = request(max_tokens=100, gateway="gw/a")
    await worker.handle(dropped, 0, 1)
    worker.engine.step(dropped.request_id, 2)
    await emitted(group, dropped, 2)
    worker.intake.on_control(event(dropped, ControlAction.DETACH, ORIGIN_ATTACHMENT, "gw/a", delivered=2,
                                   window_s=5))
    away = GatewayPresence(RedisAway(), RedisSettings(), worker.intake, check_every_s=1,  # type: ignore[arg-type]
                           grace_s=30, clock=clock)
    clock.now += 5
    await away.check()
    await pump()
    cancelled = [u.request_id for u in group.usage if u.finish_reason == "cancelled"]
    assert cancelled == [dropped.request_id]


# --- takeover: what the control topic's memory forgets ---------------------------------------------------------------


@pytest.mark.xfail(strict=True, reason="review: RecentControls' 64 events per request forget the origin's detach")
async def test_a_takeover_after_many_drops_and_resumes_still_knows_nobody_is_attached() -> None:
    """Defect: ``RecentControls`` keeps the latest 64 events per request (``control.py`` line 41), and a takeover
    rebuilds the connections by replaying them (``intake.py`` ``_listeners_of``). A client that dropped and resumed
    more than 32 times has lost its origin connection's DETACH from that memory: the successor takes the origin for
    attached (its gateway lives), so it never holds and its window never runs. (The 50,000-request LRU,
    ``capacity``, forgets a busy platform's older streams the same way.)

    Consequence: after a worker failover the abandoned stream is generated to ``max_tokens`` into the log and billed
    whole: the resume window no longer bounds the work, and the client is billed for an answer it left."""
    group, worker, req, _presence, _redis, clock = await generating()
    w2 = make("w2", group, FakeEngine(auto=False))
    w2.intake.clock = clock
    worker.engine.step(req.request_id, 4)
    await emitted(group, req, 4)
    history = [event(req, ControlAction.DETACH, ORIGIN_ATTACHMENT, "gw/a", delivered=4, window_s=30)]
    for n in range(40):  # a flaky mobile network: back and gone again, each time within the window
        history += [event(req, ControlAction.ATTACH, f"r{n}", "gw/a"),
                    event(req, ControlAction.DETACH, f"r{n}", "gw/a", delivered=4, window_s=30)]
    for control in history:  # every worker reads the whole control topic
        worker.intake.on_control(control)
        w2.intake.on_control(control)
    first_owner_attended = worker.intake.jobs[req.request_id].listeners.live
    assert not first_owner_attended  # the first owner knows
    await worker.assign()  # it dies
    await w2.assign(0)
    await w2.handle(req.model_copy(deep=True), 0, 0)
    await pump()
    attended = w2.intake.jobs[req.request_id].listeners.live
    assert not attended


# --- C1 during a rolling upgrade: a pre-v3 cancel misattributed -------------------------------------------------------


@pytest.mark.xfail(strict=True, reason="review: a v2 cancel from another process of the origin's fleet is the origin's")
async def test_a_v2_cancel_from_another_process_of_the_origin_gateways_fleet_does_not_lower_the_bill() -> None:
    """Defect: a cancel of a pre-v3 gateway (no attachment) is taken for the accepting connection's own when its
    issuer's id and the accepting gateway's id agree before their first "/" (``listeners.py`` line 71). The processes
    of one ``kns gateway --processes N`` fleet are ``<host:port>/<index>`` (``producers/gateway/fleet.py`` line 28),
    each gateway id ``<instance>/<incarnation>`` (``producers/relay/claim.py`` line 71): every process of the fleet
    matches the accepting one. A v2 process of the fleet (one restarted from old code, or not yet rolled) resuming
    the stream and dropped at once detaches the *origin*, reporting 0.

    Consequence: issue 37 C1 reopened during a rolling upgrade: the client on the accepting process keeps every token,
    the bill is 0 completion tokens, TPM refunded. (The instance is the gateway id without its last segment.)"""
    origin = "host:8000/0/ab12cd34"
    group, worker, req, _presence, _redis, _clock = await generating(origin, alive=(origin,))
    worker.engine.step(req.request_id, 30)
    await emitted(group, req, 30)
    worker.intake.on_control(ControlEvent(request_id=req.request_id, action=ControlAction.CANCEL,
                                          reason="client disconnected", issued_by="host:8000/1",
                                          issued_at=utcnow(), delivered_tokens=0))
    await worker.settle()
    billed = [u.completion_tokens for u in group.usage]
    in_log = group.log.client_view(req.request_id)[1].tokens
    assert (in_log, billed) == (30, [30])


# --- metrics ----------------------------------------------------------------------------------------------------------


@pytest.mark.xfail(strict=True, reason="review: the worker's TTFT is observed once per held delta")
async def test_the_time_to_first_token_is_observed_once_for_a_stream_held_before_its_first_token() -> None:
    """Defect: ``_relay_deltas`` observes ``kns_worker_ttft_seconds`` while ``job.seq == 0 and job.tokens ==
    job.prefix.tokens`` (``intake.py`` line 567); a held delta advances neither, so each delta held before the first
    emission is observed again.

    Consequence: the TTFT histogram counts a dropped stream once per engine step of its drop: a fleet with dropped
    clients shows an inflated count and a TTFT distribution skewed by the steps of held streams."""
    group, worker, req, _presence, _redis, _clock = await generating()
    before = counter("kns_worker_ttft_seconds_count")
    worker.intake.on_control(event(req, ControlAction.DETACH, ORIGIN_ATTACHMENT, "gw/a", delivered=0, window_s=30))
    worker.engine.step(req.request_id, 5)  # held
    await pump()
    worker.intake.on_control(event(req, ControlAction.ATTACH, "r1", "gw/b"))
    worker.engine.step(req.request_id, 1)
    await emitted(group, req, 6)
    observed = counter("kns_worker_ttft_seconds_count") - before
    assert observed == 1


@pytest.mark.xfail(strict=True, reason="review: held tokens nobody came back for are counted 'resumed'")
async def test_held_tokens_of_an_answer_that_ends_with_nobody_back_are_not_counted_resumed() -> None:
    """Defect: ``_unhold`` counts what it releases as ``kns_worker_unattended_tokens_total{fate="resumed"}``
    (``intake.py`` line 601), and the final of an answer that ends while nobody is attached releases its held output
    through it (line 573) though no client came back. Held output dropped by a revoke or a stop is counted under no
    fate.

    Consequence: the metric issue 36 asks for ("tokens generated for dropped clients, and its cost") reports work
    done for nobody as delivered to returning clients."""
    group, worker, req, _presence, _redis, _clock = await generating(max_tokens=10)
    before = counter("kns_worker_unattended_tokens_total", fate="resumed")
    worker.engine.step(req.request_id, 3)
    await emitted(group, req, 3)
    worker.intake.on_control(event(req, ControlAction.DETACH, ORIGIN_ATTACHMENT, "gw/a", delivered=3, window_s=30))
    worker.engine.step(req.request_id, 7)  # ends, nobody attached
    await worker.settle()
    resumed = counter("kns_worker_unattended_tokens_total", fate="resumed") - before
    assert resumed == 0


def test_recent_controls_keep_64_events_per_request() -> None:
    """The bound the takeover test above runs into (a guard that it still is what the test assumes)."""
    assert RecentControls.PER_REQUEST == 64
