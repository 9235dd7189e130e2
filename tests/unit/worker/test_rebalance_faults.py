"""Rebalances under faults of the Kafka side (the real Intake, OffsetTracker and rebalance listener over the fakes):
a partition takeover that fails or stalls (``rebalance.py`` ``on_partitions_assigned``), and a request that finished
while its commit is still on its way when its partition is revoked (the listener's flushes, on revoke and on
release). Each test asserts what the client's stream and the bill show."""

from __future__ import annotations

import asyncio

from aiokafka import TopicPartition
from aiokafka.errors import KafkaConnectionError, KafkaTimeoutError

from inference_workers.synthetic import expected_completion
from schemas.errors import FatalError
from schemas.events import ChatRequest
from tests.fakes.engine import FakeEngine
from tests.fakes.kafka import FakeGroup
from tests.fakes.worker import TOPIC, FakeWorker, make, pump, request, until

P0, P1 = TopicPartition(TOPIC, 0), TopicPartition(TOPIC, 1)


def uninterrupted(req: ChatRequest) -> str:
    return expected_completion(req.prompt_token_ids, req.sampling)[1]


def fatal_error(worker: FakeWorker) -> BaseException | None:
    """What the worker stops on (``worker.py`` exits non-zero with it); None while it carries on."""
    return worker.intake.fatal.exception() if worker.intake.fatal.done() else None


async def test_a_worker_whose_partition_takeover_fails_stops_and_the_next_owner_continues_the_stream() -> None:
    group = FakeGroup()
    w1 = make("w1", group, FakeEngine(auto=False))
    await w1.assign(0)
    req = request(max_tokens=6)
    await w1.handle(req, 0, 0)
    w1.engine.step(req.request_id, 3)
    await pump()
    await w1.assign()  # partition 0 moves on mid-stream

    w2 = make("w2", group)
    w2.transactions.fail_with = KafkaConnectionError("the transaction coordinator is unreachable")
    await w2.assign(0)
    await w2.handle(req, 0, 0)  # the record, fetched again by the new owner
    failure = fatal_error(w2)
    assert isinstance(failure, FatalError) and "could not take over partitions [0]" in str(failure), failure
    assert w2.engine.generations == []  # nothing is served from a partition whose transactional id it lacks
    assert w2.intake.accepts(P0) is False

    w3 = make("w3", group)  # the group without the stopped worker
    await w3.assign(0)
    await w3.handle(req, 0, 0)
    await w3.settle()
    text, stream = group.log.client_view(req.request_id)
    assert stream.error is None and stream.final is not None
    assert text == uninterrupted(req)
    (usage,) = group.usage  # billed once, by the worker that finished it
    assert (usage.worker_id, usage.prompt_tokens, usage.completion_tokens) == ("w3", 4, 6)


async def test_the_streams_of_kept_partitions_go_on_while_a_takeover_stalls_and_nothing_new_is_admitted() -> None:
    group = FakeGroup()
    worker = make("w1", group, FakeEngine(auto=False))
    await worker.assign(1)
    kept = request(max_tokens=4)
    await worker.handle(kept, 1, 0)
    worker.engine.step(kept.request_id, 2)
    await pump()

    worker.transactions.hold = asyncio.Event()  # the previous owner's transaction is still ending
    rebalance = asyncio.create_task(worker.assign(0, 1))  # partition 1 kept, partition 0 gained
    await until(lambda: P0 in worker.transactions.acquiring)
    later = request()
    fetched = asyncio.create_task(worker.handle(later, 1, 1))  # the next record of the kept partition
    worker.engine.step(kept.request_id, 2)
    await until(lambda: group.usage)
    text, stream = group.log.client_view(kept.request_id)
    assert stream.final is not None and text == uninterrupted(kept)  # finished and committed during the stall
    assert not fetched.done() and later.request_id not in worker.intake.jobs  # admission waits for the takeover

    worker.transactions.fail_with = KafkaTimeoutError()
    worker.transactions.hold.set()
    await asyncio.gather(rebalance, fetched)
    assert isinstance(fatal_error(worker), FatalError)
    assert later.request_id not in worker.intake.jobs  # the worker stops: the next owner serves it
    assert [u.request_id for u in group.usage] == [kept.request_id]


async def test_a_request_finished_before_a_revoke_is_committed_by_its_worker_before_the_partition_moves() -> None:
    group = FakeGroup()
    w1 = make("w1", group, FakeEngine(auto=False))
    w1.finalizer.slow = True
    await w1.assign(0)
    req = request(max_tokens=4)
    await w1.handle(req, 0, 0)
    w1.engine.step(req.request_id, 4)
    await until(lambda: w1.finalizer.pending)  # generated; its transaction is on its way

    await w1.revoke()  # a rebalance: w1 rejoins, and meanwhile ...
    w2 = make("w2", group)
    await w2.assign(0)  # ... partition 0 is assigned to w2, whose producer fences w1's
    await w1.assigned()
    w1.finalizer.land()  # whatever was still on its way arrives now
    await w2.handle(req, 0, 0)
    await w2.settle()
    await w1.settle()

    text, stream = group.log.client_view(req.request_id)
    assert stream.error is None and stream.final is not None and text == uninterrupted(req)
    assert stream.final.worker_id == "w1"  # the client's stream ended with the generation it came from
    (usage,) = group.usage
    assert (usage.worker_id, usage.attempt, usage.completion_tokens) == ("w1", 1, 4)
    assert w2.engine.generations == []  # not generated a second time


async def test_a_request_finished_during_a_rebalance_is_committed_by_its_worker_before_it_gives_the_partition_up(
        ) -> None:
    group = FakeGroup()
    w1 = make("w1", group, FakeEngine(auto=False))
    w1.finalizer.slow = True
    await w1.assign(0)
    req = request(max_tokens=4)
    await w1.handle(req, 0, 0)
    w1.engine.step(req.request_id, 3)
    await pump()

    await w1.revoke()  # a rebalance starts; the request keeps generating while w1 rejoins
    w1.engine.step(req.request_id, 1)
    await until(lambda: w1.finalizer.pending)  # it finished meanwhile; its transaction is on its way
    await w1.assigned()  # partition 0 moved away
    w2 = make("w2", group)
    await w2.assign(0)
    w1.finalizer.land()
    await w2.handle(req, 0, 0)
    await w2.settle()

    text, stream = group.log.client_view(req.request_id)
    assert stream.error is None and stream.final is not None and text == uninterrupted(req)
    assert stream.final.worker_id == "w1"
    (usage,) = group.usage
    assert (usage.worker_id, usage.attempt, usage.completion_tokens) == ("w1", 1, 4)
    assert w2.engine.generations == []
