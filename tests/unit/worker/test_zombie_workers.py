"""Rebalances with a zombie (a worker that missed a generation of the group), from an adversarial review: each
test failed on the first version of the rebalance code for the reason in its docstring.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from functools import partial
from types import SimpleNamespace

from aiokafka import TopicPartition
from aiokafka.coordinator.protocol import ConsumerProtocolMemberAssignment
from aiokafka.errors import KafkaConnectionError

from inference_workers.assignor import Member, StickyLoadAssignor, assign, decode_member
from inference_workers.rebalance import Membership
from inference_workers.worker import still_member
from schemas.events import ChatRequest
from tests.fakes.engine import FakeEngine
from tests.fakes.kafka import FakeGroup
from tests.fakes.worker import TOPIC, make, pump, request, stop_made_workers
from tests.helpers import run_in_virtual_time

P0 = TopicPartition(TOPIC, 0)


def copy(req: ChatRequest) -> ChatRequest:
    return req.model_copy(deep=True)


async def test_an_expelled_worker_that_the_assignor_gives_its_partition_back_acquires_it_and_aborts_stale_work(
) -> None:
    """An adversarial review's scenario (promises 1 and 2): w1 streams R on p0 and stalls past the session
    timeout; the group gives p0 to w2, which fences w1 and takes R over (attempt 2). w1 wakes and rejoins; the
    real assignor gives p0 back to w1, because w1 reports more requests in flight on p0 (a contested partition goes
    to the busier claimant, assignor.py). The first version counted p0 as *kept* (w1 still held its old, fenced
    producer): no acquire, w2 not fenced back, w1's stale attempt 1 went on streaming into a stream the relay had
    moved past. Checked here: w1 acquires p0 again (fencing w2), neither w1's attempt 1 nor w2's attempt 2 goes on
    generating, and R, re-fetched, is taken over under a newer attempt and reaches its client whole, billed once.
    (What happens when w1 then serves p0 is the next test.)"""
    group = FakeGroup()
    w1, w2 = make("w1", group, FakeEngine(auto=False)), make("w2", group, FakeEngine(auto=False))
    await w1.assign(0)
    req = request(max_tokens=6)
    await w1.handle(req, 0, 0)
    w1.engine.step(req.request_id, 2)
    await pump()

    # w1 is stalled; the group moves p0 to w2 (w1's listener does not run)
    await w2.assign(0)
    await w2.handle(copy(req), 0, 0)
    w2.engine.step(req.request_id, 1)
    await pump()
    assert group.txn_owner[P0] == "w2"
    first, second = w1.engine.generation(req.request_id), w2.engine.generation(req.request_id)

    # w1 rejoins; both claim p0 (w1's StickyLoadAssignor._owned is not cleared when it is kicked out) and the real
    # assignor settles it by the loads each reports.
    p1 = TopicPartition(TOPIC, 1)
    after = assign({TOPIC: [0, 1]}, {"w1": Member({TOPIC}, {P0}, {P0: w1.offsets.open_count(P0) + 4}),
                                      "w2": Member({TOPIC}, {P0, p1}, {P0: w2.offsets.open_count(P0)})})
    assert after == {"w1": {P0}, "w2": {p1}}
    await w1.assign(*(tp.partition for tp in after["w1"]))
    await w2.assign(*(tp.partition for tp in after["w2"]))
    assert group.txn_owner[P0] == "w1", "w1 treated p0 as kept: it still commits with the producer w2 fenced"
    assert first.aborted and second.aborted, "a stale attempt of R goes on generating"
    assert req.request_id not in w1.intake.jobs and req.request_id not in w2.intake.jobs

    await w1.handle(copy(req), 0, 0)  # re-fetched from the committed offset
    await pump()
    assert w1.intake.jobs[req.request_id].attempt > 2
    w1.engine.step(req.request_id, 6)
    await w1.settle()
    _, stream = group.log.client_view(req.request_id)
    assert stream.final is not None and stream.error is None and stream.tokens == 6
    assert [u.completion_tokens for u in group.usage] == [6]


async def test_a_zombie_that_regains_its_partition_takes_it_over_cleanly_and_serves_it() -> None:
    """Step 5 of the previous scenario. An expelled worker that gets its partition back must not keep its fenced
    producer (a 'kept' partition it could never commit on, dropped at the first fenced commit while the group
    still assigns it to this worker: nobody would serve it). Expelled, it drops everything; regained, the
    partition is acquired again (fencing the previous owner), its requests are taken over, and it is served."""
    group = FakeGroup()
    w1, w2 = make("w1", group, FakeEngine(auto=False)), make("w2", group, FakeEngine(auto=False))
    await w1.assign(0)
    req = request(max_tokens=3)
    await w1.handle(req, 0, 0)
    w1.engine.step(req.request_id, 1)
    await pump()
    await w2.assign(0)  # w1 stalled: p0 moves to w2, w1 fenced
    await w2.handle(copy(req), 0, 0)
    await pump()
    await w1.assign(0)  # w1 rejoins (it was expelled) and p0 comes back to it
    await w2.assign()
    assert group.txn_owner[P0] == "w1"  # acquired again, not kept with the fenced producer
    await w1.handle(copy(req), 0, 0)  # re-fetched from the committed offset: taken over
    w1.engine.step(req.request_id, 2)
    await w1.settle()
    (usage,) = group.usage
    _, stream = group.log.client_view(req.request_id)
    assert stream.final is not None and stream.error is None
    assert (usage.completion_tokens, stream.tokens) == (3, 3)

    later = request()
    await w1.handle(later, 0, 1)  # a new request on p0, which the group assigns to w1
    await pump()
    assert any(g.request_id.startswith(later.request_id) for g in w1.engine.generations), (
        "p0 is assigned to w1 by the group but w1 refuses its records: nobody serves p0")


async def test_a_zombie_that_refetches_a_record_of_the_new_owner_leaves_it_alone() -> None:
    """Promise 1. Fetching needs no group membership: a worker that resumes after a stall longer than the session
    timeout keeps fetching and admitting from its old assignment until its next heartbeat tells it to rejoin. Its
    position on p0 is behind what the new owner w2 has already taken, so it re-fetches a record w2 is generating
    right now. It must not take the request over (that would make the rightful owner's stream stale at the relay
    and leave the client hanging): its claim is from an older generation, so it is stale."""
    group = FakeGroup()
    w1, w2 = make("w1", group, FakeEngine(auto=False)), make("w2", group, FakeEngine(auto=False))
    await w1.assign(0)  # w1 owns p0 ... and stalls (before fetching offset 0)
    await w2.assign(0)  # the group gives p0 to w2 (w1 missed the rebalance)
    req = request(max_tokens=6)
    await w2.handle(req, 0, 0)
    w2.engine.step(req.request_id, 2)
    await pump()

    await w1.handle(copy(req), 0, 0)  # w1 resumes: its fetch from its old position returns offset 0
    await pump()
    assert w1.prefix.reads == 0 and w1.engine.served() == []  # left alone
    assert not w1.intake.accepts(P0)  # and it admits nothing more from p0 until the group tells it what it owns
    await w1.assign()  # its next heartbeat: rejoin; p0 is w2's
    w2.engine.step(req.request_id, 4)  # the rightful owner finishes and commits it
    await w2.settle()

    _, stream = group.log.client_view(req.request_id)
    assert stream.final is not None and stream.error is None and stream.tokens == 6
    assert [u.completion_tokens for u in group.usage] == [6]


async def test_a_partition_fenced_while_still_assigned_to_this_worker_is_served_again() -> None:
    """Ninth session (left open since the seventh). A fencing also comes without another owner: a transaction
    that outlives ``transaction.timeout.ms`` (a stall mid-commit) is aborted by the coordinator, which bumps the
    producer's epoch, and the next commit is refused as fenced. ``partition_lost`` then dropped the partition and
    waited for "the group to tell us", but the group still assigned it to this worker and nothing rebalanced: no
    record of p0 was admitted until some unrelated membership change. The worker now rejoins without it; the
    request it was streaming is taken over under a newer attempt (one sample, not a splice of two)."""
    group = FakeGroup()
    w1 = make("w1", group, FakeEngine(auto=False))
    await w1.assign(0)
    req = request(max_tokens=6, temperature=0.8)  # sampled, no seed: a second generation would differ
    await w1.handle(req, 0, 0)
    w1.engine.step(req.request_id, 2)
    await pump()
    group.txn_owner[P0] = "the coordinator (transaction timed out)"
    await w1.listener.partition_lost(P0)
    await w1.listener.membership_checked()
    assert w1.rejoins == [{P0}], "the partition stays assigned to this worker, and nobody serves it"
    await w1.assign(0)  # the rebalance the rejoin brings: p0 comes back and is taken over
    assert group.txn_owner[P0] == "w1"
    await w1.handle(copy(req), 0, 0)  # re-fetched from the committed offset
    await pump()
    job = w1.intake.jobs[req.request_id]
    assert job.takeover and job.attempt > 1
    w1.engine.step(req.request_id, 4)
    await w1.settle()
    _, stream = group.log.client_view(req.request_id)
    assert stream.final is not None and stream.error is None and stream.tokens == 6
    assert w1.rejoins == [{P0}], "the takeover judged its own earlier attempt a newer owner and dropped p0 again"
    later = request()
    await w1.handle(later, 0, 1)
    await pump()
    assert any(g.request_id.startswith(later.request_id) for g in w1.engine.generations)


async def test_a_partition_lost_after_it_was_released_asks_for_no_rebalance() -> None:
    """The handler runs late (it waits for the admission lock): when a rebalance has already taken the partition
    away, there is nothing to serve and no reason to rebalance the group again."""
    group = FakeGroup()
    w1 = make("w1", group, FakeEngine(auto=False))
    await w1.assign(0)
    await w1.assign()
    await w1.listener.partition_lost(P0)
    await w1.listener.membership_checked()
    assert w1.listener._rejoining is None and w1.rejoins == []  # no check was even started


async def test_an_expelled_worker_fenced_on_a_partition_leaves_the_rejoin_to_its_consumer() -> None:
    """Review of the rejoin: a worker stalled past the session timeout was expelled, and its fenced commit may run
    before its heartbeat says so. A rejoin asked then would revoke its partitions as kept, not as expelled (its
    assignor still claiming them all). It waits for the heartbeat's verdict: expelled, or a rebalance since, and
    it leaves the rejoin to the consumer."""
    for change in ("expelled", "rebalanced"):
        group = FakeGroup()
        w1 = make("w1", group, FakeEngine(auto=False))
        await w1.assign(0)
        group.txn_owner[P0] = "w2"
        await w1.listener.partition_lost(P0)
        w1.generation = -1 if change == "expelled" else w1.generation + 1  # before the membership check
        await w1.listener.membership_checked()
        assert w1.rejoins == [], change


async def test_partitions_fenced_together_are_given_up_in_one_rejoin() -> None:
    """Review of the rejoin: a stalled commit fences every partition of the worker at once; one rebalance, not
    one per partition (each is a group-wide eager rebalance)."""
    group = FakeGroup()
    w1 = make("w1", group, FakeEngine(auto=False))
    await w1.assign(0, 1)
    p1 = TopicPartition(TOPIC, 1)
    group.txn_owner[P0] = group.txn_owner[p1] = "the coordinator (transaction timed out)"
    await asyncio.gather(w1.listener.partition_lost(P0), w1.listener.partition_lost(p1))
    await w1.listener.membership_checked()
    assert w1.rejoins == [{P0, p1}]


def test_a_member_that_gives_partitions_up_joins_with_other_metadata() -> None:
    """Review of the rejoin: Kafka's coordinator answers a follower that rejoins with unchanged metadata with the
    current generation (no rebalance). Its partitions came back under the generation that had numbered their
    requests' attempts: a takeover saw its own earlier attempt as a newer owner (dropped the partition again, for
    ever), or a request not yet committed as open was generated again from token 0 under the same attempt and its
    client got two samples spliced. The metadata now changes, so the rejoin is a rebalance: a new generation."""
    p1 = TopicPartition(TOPIC, 1)
    assignor = StickyLoadAssignor(lambda: {P0: 1, p1: 1})
    assignor.on_assignment(ConsumerProtocolMemberAssignment(0, [(TOPIC, [0, 1])], b""))
    before = assignor.metadata([TOPIC])
    assignor.disown({P0})
    after = assignor.metadata([TOPIC])
    assert after.user_data != before.user_data
    assert decode_member([TOPIC], after.user_data).owned == {p1}
    assignor.on_assignment(ConsumerProtocolMemberAssignment(0, [(TOPIC, [0, 1])], b""))  # given back: same owned
    assert assignor.metadata([TOPIC]).user_data != before.user_data, "the same metadata as the join before"


def virtually(scenario: Callable[[], Awaitable[None]]) -> None:
    """Run a scenario on a virtual clock: the membership check's waits and backoff take no wall time and fire in
    their order whatever the machine's load; its workers are cleaned up on the same loop."""
    async def run() -> None:
        try:
            await scenario()
        finally:
            await stop_made_workers()

    run_in_virtual_time(run)


def test_a_partition_fenced_after_a_rebalance_while_an_older_check_waits_is_given_up() -> None:
    """Second review of the rejoin: P0 fenced in generation G started the membership check; a rebalance (G+1)
    gave P0 back; P1 fenced in G+1 joined the waiting check, which woke, saw G+1 != G and dropped both: P1 stayed
    assigned to this worker, which no longer served it."""
    async def scenario() -> None:
        group = FakeGroup()
        w1 = make("w1", group, FakeEngine(auto=False))
        w1.listener._membership_check_s = 0.2
        await w1.assign(0, 1)
        await w1.listener.partition_lost(P0)
        await w1.assign(0, 1)  # an unrelated rebalance: P0 regained
        p1 = TopicPartition(TOPIC, 1)
        await w1.listener.partition_lost(p1)
        assert w1.rejoins == [], "the check did not wait"
        await w1.listener.membership_checked()
        assert w1.rejoins == [{p1}]

    virtually(scenario)


def test_a_partition_regained_in_the_generation_it_was_lost_in_is_not_given_up() -> None:
    """Second review of the rejoin: aiokafka takes the new generation from the JoinGroup answer, before SyncGroup
    and the assignment. A fencing handled in between reads the new generation; the assignment then gives the
    partition back (the join still claimed it), and the check gave it up all the same: another group-wide
    rebalance, which may move a partition being served."""
    async def scenario() -> None:
        group = FakeGroup()
        w1 = make("w1", group, FakeEngine(auto=False))
        w1.listener._membership_check_s = 0.2
        await w1.assign(0)
        await w1.listener.on_partitions_revoked(w1.transactions.owned())  # a rebalance starts
        group.generation += 1
        w1.generation = group.generation  # JoinGroup answered
        await w1.listener.partition_lost(P0)
        await w1.listener.on_partitions_assigned({P0})  # SyncGroup: P0 back, gained
        await w1.listener.membership_checked()
        assert w1.rejoins == []

    virtually(scenario)


def test_a_stopping_worker_asks_for_no_rebalance() -> None:
    """Second review of the rejoin: a check that fired while the worker drained rebalanced the group on its way
    out (partitions handed to a member that no longer consumes)."""
    async def scenario() -> None:
        group = FakeGroup()
        w1 = make("w1", group, FakeEngine(auto=False))
        w1.listener._membership_check_s = 0.2
        await w1.assign(0)
        await w1.listener.partition_lost(P0)
        w1.listener.stop()
        await w1.listener.membership_checked()
        assert w1.rejoins == []

    virtually(scenario)


async def test_a_worker_the_coordinator_no_longer_counts_a_member_does_not_rejoin_on_its_own() -> None:
    """Second review of the rejoin: waiting for the heartbeat was a guess. An expelled worker whose heartbeats go
    unanswered longer (the coordinator moving) still read its old generation and rejoined with its partitions
    revoked as kept, not as expelled (claiming them all). It now asks the coordinator first."""
    group = FakeGroup()
    w1 = make("w1", group, FakeEngine(auto=False))
    asked: list[int] = []

    async def not_a_member(generation: int) -> Membership:
        asked.append(generation)
        return Membership.NOT_MEMBER

    w1.listener._still_member = not_a_member
    await w1.assign(0)
    await w1.listener.partition_lost(P0)
    await w1.listener.membership_checked()
    assert asked == [w1.generation] and w1.rejoins == []


def test_a_partition_fenced_while_the_worker_drains_asks_for_no_rebalance() -> None:
    """Third review: stop() cancelled the waiting check, but a commit fenced later (during the drain: the consumer
    is a member until it stops) started a new one, which rebalanced the group on the worker's way out."""
    async def scenario() -> None:
        group = FakeGroup()
        w1 = make("w1", group, FakeEngine(auto=False))
        w1.listener._membership_check_s = 0.05
        await w1.assign(0)
        w1.listener.stop()
        await w1.listener.partition_lost(P0)
        assert w1.listener._rejoining is None, "a membership check started after stop()"
        assert w1.rejoins == []

    virtually(scenario)


def test_a_membership_question_left_unanswered_is_asked_again_with_backoff() -> None:
    """Third review: "no answer" (a timeout, the coordinator moving) read as "not a member" dropped the fenced
    partitions from the check for good; the consumer's own heartbeat does not rejoin when the coordinator it finds
    next still knows the member, so the partition stayed assigned here, served by nobody. Asked again, after
    0.01 s, then backing off (0.1 s, 0.2 s) while the coordinator does not answer."""
    async def scenario() -> None:
        group = FakeGroup()
        w1 = make("w1", group, FakeEngine(auto=False))
        w1.listener._membership_check_s = 0.01
        answers = [KafkaConnectionError("the coordinator is moving"), SimpleNamespace(error_code=15),
                   SimpleNamespace(error_code=0)]
        loop = asyncio.get_running_loop()
        asked_at: list[float] = []

        async def send_req(request: object) -> object:
            asked_at.append(loop.time())
            answer = answers.pop(0)
            if isinstance(answer, Exception):
                raise answer
            return answer

        consumer = SimpleNamespace(_coordinator=SimpleNamespace(group_id="g", member_id="m", _send_req=send_req))
        w1.listener._still_member = partial(still_member, consumer, 1.0)  # type: ignore[arg-type]
        await w1.assign(0)
        lost_at = loop.time()
        await w1.listener.partition_lost(P0)
        await w1.listener.membership_checked()
        assert answers == [] and w1.rejoins == [{P0}]
        assert [round(t - lost_at, 6) for t in asked_at] == [0.01, 0.11, 0.31]

    virtually(scenario)


def test_a_partition_regained_while_the_coordinator_answers_is_not_given_up() -> None:
    """Third review: the partitions to give up were chosen before the membership question. One fenced between a
    JoinGroup and its SyncGroup (the new generation already read) and given back by that assignment while the
    question waited on the same connection was given up all the same: another group-wide rebalance."""
    async def scenario() -> None:
        group = FakeGroup()
        w1 = make("w1", group, FakeEngine(auto=False))
        w1.listener._membership_check_s = 0.01
        await w1.assign(0)
        await w1.listener.on_partitions_revoked(w1.transactions.owned())
        group.generation += 1
        w1.generation = group.generation  # JoinGroup answered
        await w1.listener.partition_lost(P0)
        asked: list[int] = []

        async def member_once_synced(generation: int) -> Membership:
            asked.append(generation)
            await w1.listener.on_partitions_assigned({P0})  # SyncGroup answered first: P0 back, gained
            return Membership.MEMBER

        w1.listener._still_member = member_once_synced
        await w1.listener.membership_checked()
        assert asked == [w1.generation], "the coordinator was never asked: the race was not run"
        assert P0 in w1.transactions.owned() and w1.rejoins == []

    virtually(scenario)


def test_an_error_while_asking_the_coordinator_is_asked_again() -> None:
    """Third review: an exception the question did not expect ended the check's task, and the partitions it had
    taken out of the set with it."""
    async def scenario() -> None:
        group = FakeGroup()
        w1 = make("w1", group, FakeEngine(auto=False))
        w1.listener._membership_check_s = 0.01
        answers: list[Membership | Exception] = [RuntimeError("unexpected"), Membership.MEMBER]

        async def flaky(generation: int) -> Membership:
            answer = answers.pop(0)
            if isinstance(answer, Exception):
                raise answer
            return answer

        w1.listener._still_member = flaky
        await w1.assign(0)
        await w1.listener.partition_lost(P0)
        await w1.listener.membership_checked()
        assert answers == [] and w1.rejoins == [{P0}]

    virtually(scenario)
