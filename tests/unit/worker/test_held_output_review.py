"""Adversarial review of 86f95a9 (issue 36 item 1, issue 37 C1), the worker's side: output held while no client
connection was attached, the billing rule of ``inference_workers/listeners.py`` and what a takeover inherits from the
control topic. Each test states a defect the review found, its consequence for a user or a bill, and the code line
(line numbers as of 86f95a9); each failed on 86f95a9 for that reason and passes since the generation is suspended
while nobody is attached and a stopped one is billed what the log holds."""

from __future__ import annotations

import asyncio

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


async def test_output_after_a_dropped_clients_return_is_screened_by_the_post_filter_like_any_output() -> None:
    """Review finding (fixed): while nobody was attached the worker held the engine's output and released it *as one
    delta* when a client came back; the post-filter classifies only the last ``post_window_chars`` of each event, so
    everything generated during the drop but its last 320 characters reached the client unscreened: a safety bypass
    any client could trigger (drop at once, resume). Now the generation is suspended while nobody is attached and goes
    on at the engine's pace once a client is back: one delta per step, every character in a screened window."""
    group, worker, req, _presence, _redis, _clock = await generating(max_tokens=120)
    worker.engine.step(req.request_id, 2)
    await emitted(group, req, 2)
    worker.intake.on_control(event(req, ControlAction.DETACH, ORIGIN_ATTACHMENT, "gw/a", delivered=2, window_s=30))
    worker.engine.step(req.request_id, 1)  # generated after the drop: dropped unsent, the generation suspended
    await until(lambda: worker.intake.jobs[req.request_id].suspended)
    worker.intake.on_control(event(req, ControlAction.ATTACH, "r1", "gw/b"))  # the client is back
    worker.engine.step(req.request_id, 118)  # the rest, from where the log ends
    await worker.settle()
    tokens, missing = group.log.client_view(req.request_id)[1].tokens, unscreened(group.log.events(req.request_id))
    assert (tokens, missing) == (120, 0)
    assert all(len(e.token_ids) <= 1 for e in group.log.events(req.request_id))  # no burst


async def until(predicate: object, turns: int = 10_000) -> None:
    for _ in range(turns):
        if predicate():  # type: ignore[operator]
            return
        await asyncio.sleep(0)
    raise AssertionError("the condition never held")


# --- billing: an abandoned stream billed in full ---------------------------------------------------------------------


async def test_an_abandoned_stream_that_ends_within_its_window_is_billed_what_its_client_received() -> None:
    """Fixed (the module docstring says how).
    The defect: a generation that ends while nobody is attached emits everything it held in its final and is billed
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


async def test_every_token_a_late_resume_can_read_is_billed_when_a_dropped_client_never_returns() -> None:
    """Fixed (the module docstring says how).
    The defect: the worker emits while it still counts the dropped connection as attached: until its DETACH has gone
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


async def test_a_dead_gateways_stream_is_billed_what_it_relayed_and_stops_generating_once_its_death_is_found(
) -> None:
    """The review's free-token finding for a gateway that died, answered, not closed: a connection whose gateway
    died is billed what was emitted while that gateway was last seen alive (a crash of ours is not the client's to
    pay). What was emitted between the crash and its discovery stays in the log, readable by a late resume within the
    resume TTL unbilled: bounded by one presence check plus the gateway's liveness TTL, because the generation is
    suspended as soon as the death is found (before, it went on for the whole window). The review's first version of
    this test asked that those tokens be billed."""
    group, worker, req, presence, redis, clock = await generating(grace_s=30)
    worker.engine.step(req.request_id, 3)
    await emitted(group, req, 3)
    await presence.check()  # alive: 3 out
    worker.engine.step(req.request_id, 5)
    await emitted(group, req, 8)  # the gateway dies meanwhile; its liveness key lapses before the next check
    redis.alive = set()
    await presence.check()
    worker.engine.step(req.request_id, 20)  # the next step finds nobody attached: suspended, nothing more emitted
    await until(lambda: worker.intake.jobs[req.request_id].suspended)
    clock.now += 30
    await presence.check()
    await worker.settle()
    billed = [u.completion_tokens for u in group.usage]
    in_log = group.log.client_view(req.request_id)[1].tokens
    assert (in_log, billed) == (8, [3])


# --- Redis away: the windows that need no Redis stop running ---------------------------------------------------------


class RedisAway:
    async def mget(self, keys: list[str]) -> list[str | None]:
        raise RedisConnectionError("Redis is restarting")


async def test_a_dropped_clients_window_ends_while_redis_is_away() -> None:
    """Fixed (the module docstring says how).
    The defect: the presence check returns before looking at any stream when the liveness lookup fails
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


async def test_a_takeover_after_many_drops_and_resumes_still_knows_nobody_is_attached() -> None:
    """Fixed (the module docstring says how).
    The defect: ``RecentControls`` keeps the latest 64 events per request (``control.py`` line 41), and a takeover
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


async def test_a_v2_cancel_from_another_process_of_the_origin_gateways_fleet_does_not_lower_the_bill() -> None:
    """Fixed (the module docstring says how).
    The defect: a cancel of a pre-v3 gateway (no attachment) is taken for the accepting connection's own when its
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


async def test_the_time_to_first_token_is_observed_once_for_a_stream_dropped_before_its_first_token() -> None:
    """Review finding (fixed): the worker's TTFT was observed for every engine delta before the first emission, a
    dropped stream's steps included. Now once, at the first token emitted."""
    group, worker, req, _presence, _redis, _clock = await generating()
    before = counter("kns_worker_ttft_seconds_count")
    worker.intake.on_control(event(req, ControlAction.DETACH, ORIGIN_ATTACHMENT, "gw/a", delivered=0, window_s=30))
    worker.engine.step(req.request_id, 1)  # generated for nobody: dropped, suspended
    await until(lambda: worker.intake.jobs[req.request_id].suspended)
    worker.intake.on_control(event(req, ControlAction.ATTACH, "r1", "gw/b"))
    worker.engine.step(req.request_id, 6)
    await emitted(group, req, 6)
    observed = counter("kns_worker_ttft_seconds_count") - before
    assert observed == 1


async def test_tokens_generated_for_nobody_are_counted_and_an_attended_stream_counts_none() -> None:
    """Issue 36: the work done after a disconnect is visible: the tokens generated once every client had gone
    (dropped unsent when the generation is suspended) count in ``kns_worker_unattended_tokens_total``."""
    group, worker, req, _presence, _redis, _clock = await generating(max_tokens=10)
    before = counter("kns_worker_unattended_tokens_total")
    worker.engine.step(req.request_id, 3)
    await emitted(group, req, 3)
    assert counter("kns_worker_unattended_tokens_total") == before
    worker.intake.on_control(event(req, ControlAction.DETACH, ORIGIN_ATTACHMENT, "gw/a", delivered=3, window_s=30))
    worker.engine.step(req.request_id, 1)
    await until(lambda: worker.intake.jobs[req.request_id].suspended)
    assert counter("kns_worker_unattended_tokens_total") - before == 1


def test_recent_controls_keep_64_events_per_request() -> None:
    """The bound the takeover test above runs into (a guard that it still is what the test assumes)."""
    assert RecentControls.PER_REQUEST == 64
