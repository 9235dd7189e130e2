"""The worker's intake, offsets and rebalance listener (the real classes) over a fake engine and fake Kafka:
rebalances mid-batch, sticky partitions, and takeovers, driven deterministically in milliseconds."""

from __future__ import annotations

import asyncio

from aiokafka import TopicPartition

from tests.fakes.engine import FakeEngine
from tests.fakes.kafka import FakeGroup
from tests.fakes.worker import TOPIC, FakeWorker, request

P0, P1, P2 = (TopicPartition(TOPIC, p) for p in range(3))


async def test_a_revoke_mid_batch_lets_no_later_record_of_the_partition_start() -> None:
    """Defect 1: a revoke arriving while the consumer loop awaited a claim used to list the jobs once, so the
    rest of the batch started 61 jobs for a partition the worker no longer owned, and offsets for it were
    committed afterwards."""
    group = FakeGroup()
    worker = FakeWorker("w1", group, FakeEngine(max_num_seqs=64, auto=False))
    await worker.assign(0)
    batch = [request(max_tokens=50) for _ in range(64)]
    for offset in range(3):
        await worker.handle(batch[offset], 0, offset)
    group.claims.hold = asyncio.Event()
    fourth = asyncio.create_task(worker.handle(batch[3], 0, 3))
    await asyncio.sleep(0)
    revoke = asyncio.create_task(worker.listener.on_partitions_revoked({P0}))
    for _ in range(5):
        await asyncio.sleep(0)
    assert not revoke.done()  # it waits for the admission in progress, then nothing more is admitted
    group.claims.hold.set()
    await asyncio.gather(fourth, revoke)
    for offset in range(4, 64):  # the rest of the fetched batch
        await worker.handle(batch[offset], 0, offset)
    assert len(worker.intake.jobs) == 4
    assert group.claims.calls == 4

    await worker.listener.on_partitions_assigned(set())  # the partition moved away
    await worker.settle()
    assert all(g.aborted for g in worker.engine.generations)
    assert worker.offsets.committable() == {} and group.committed == {}
    assert group.usage == []  # nothing was billed by the old owner: the new owner takes the requests over


async def test_a_rebalance_that_keeps_a_partition_interrupts_none_of_its_requests() -> None:
    """Defect 2: every rebalance used to abort every in-flight request of every worker."""
    group = FakeGroup()
    worker = FakeWorker("w1", group, FakeEngine(auto=False))
    await worker.assign(0, 1, 2)
    reqs = [request(max_tokens=5) for _ in range(3)]
    for p, req in enumerate(reqs):
        await worker.handle(req, p, 0)
    await worker.assign(0, 2)  # another worker joined and took partition 1
    assert set(worker.intake.jobs) == {reqs[0].request_id, reqs[2].request_id}
    assert worker.engine.generation(reqs[1].request_id).aborted
    # the kept partitions resume where this worker was, not from their committed offsets
    assert (P0, 1) in worker.seeks and (P2, 1) in worker.seeks
    for req in (reqs[0], reqs[2]):
        worker.engine.step(req.request_id, 5)
    await worker.settle()
    assert sorted(u.request_id for u in group.usage) == sorted([reqs[0].request_id, reqs[2].request_id])
    assert all(u.completion_tokens == 5 for u in group.usage)


async def test_a_refetched_record_of_a_running_request_is_ignored() -> None:
    group = FakeGroup()
    worker = FakeWorker("w1", group, FakeEngine(auto=False))
    await worker.assign(0)
    req = request()
    await worker.handle(req, 0, 0)
    await worker.handle(req, 0, 0)  # the same record fetched again (a seek, a rebalance)
    await asyncio.sleep(0)
    assert len(worker.engine.generations) == 1 and group.claims.calls == 1
    assert worker.offsets.open_count(P0) == 1  # still open: the committed offset cannot pass it
    await worker.assign()


async def test_the_next_owner_continues_from_the_emitted_prefix_with_one_prefill_and_exact_text() -> None:
    """Defect 4 (and the failover design): attempt 2 continues from the tokens attempt 1 emitted; the client's
    text equals an uninterrupted run; the request is billed once, prompt included once."""
    reference_group = FakeGroup()
    reference = FakeWorker("ref", reference_group)
    await reference.assign(0)
    req = request(max_tokens=8)
    await reference.handle(req, 0, 0)
    await reference.settle()
    uninterrupted, _ = reference_group.log.client_view(req.request_id)

    group = FakeGroup()
    first, second = FakeWorker("w1", group, FakeEngine(auto=False)), FakeWorker("w2", group)
    await first.assign(0)
    await first.handle(req, 0, 0)
    first.engine.step(req.request_id, 3)
    for _ in range(20):
        await asyncio.sleep(0)
    await first.assign()  # its partition moves: the job is aborted, nothing committed
    await second.assign(0)
    await second.handle(req, 0, 0)
    await second.settle()

    text, stream = group.log.client_view(req.request_id)
    assert text == uninterrupted and stream.error is None
    generation = second.engine.generation(req.request_id)
    assert generation.prompt == req.prompt_token_ids + first.engine.generation(req.request_id).emitted
    assert generation.sampling.max_tokens == 5
    (usage,) = group.usage
    # attempts are numbered by the group generation that gave the taking-over worker the partition
    assert (usage.prompt_tokens, usage.completion_tokens, usage.attempt) == (4, 8, second.generation)
    assert usage.attempt > (first.generation or 0)


async def test_a_seeded_sample_is_regenerated_and_the_part_the_client_has_is_checked_and_dropped() -> None:
    reference_group = FakeGroup()
    reference = FakeWorker("ref", reference_group)
    await reference.assign(0)
    req = request(max_tokens=8, temperature=0.9, seed=42)
    await reference.handle(req, 0, 0)
    await reference.settle()
    uninterrupted, _ = reference_group.log.client_view(req.request_id)

    group = FakeGroup()
    first, second = FakeWorker("w1", group, FakeEngine(auto=False)), FakeWorker("w2", group)
    await first.assign(0)
    await first.handle(req, 0, 0)
    first.engine.step(req.request_id, 4)
    for _ in range(20):
        await asyncio.sleep(0)
    await first.assign()
    await second.assign(0)
    await second.handle(req, 0, 0)
    await second.settle()
    text, stream = group.log.client_view(req.request_id)
    assert text == uninterrupted and stream.error is None
    assert second.engine.generation(req.request_id).prompt == req.prompt_token_ids  # replayed from the start


async def test_a_final_the_client_saw_from_an_aborted_transaction_is_finalized_again_not_regenerated() -> None:
    """Defect 5: a worker killed between sending its final and committing used to show the client a finish
    and usage that were then never billed, while a regeneration was."""
    group = FakeGroup()
    first, second = FakeWorker("w1", group), FakeWorker("w2", group)
    await first.assign(0)
    first.finalizer.abort_next = True
    req = request(max_tokens=6)
    await first.handle(req, 0, 0)
    await first.settle()
    seen, stream = group.log.client_view(req.request_id)
    assert stream.final is not None and group.usage == []  # the client saw [DONE]; nothing is billed yet

    await first.assign()
    await second.assign(0)
    await second.handle(req, 0, 0)
    await second.settle()
    assert second.engine.served() == []  # nothing generated again
    (usage,) = group.usage
    assert stream.final.usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (stream.final.usage.prompt_tokens,
                                                              stream.final.usage.completion_tokens)
    assert group.log.client_view(req.request_id)[0] == seen


async def test_a_takeover_cancelled_before_it_runs_bills_what_the_client_received_prompt_included() -> None:
    """Defect 10: a redelivered attempt cancelled before it ran billed 0 prompt tokens even when an earlier
    attempt had produced output."""
    group = FakeGroup()
    first, second = FakeWorker("w1", group, FakeEngine(auto=False)), FakeWorker("w2", group)
    await first.assign(0)
    req = request(max_tokens=10)
    await first.handle(req, 0, 0)
    first.engine.step(req.request_id, 3)
    for _ in range(20):
        await asyncio.sleep(0)
    await first.assign()
    from schemas.events import ControlAction, ControlEvent, utcnow

    second.intake.on_control(ControlEvent(request_id=req.request_id, action=ControlAction.CANCEL, reason="gone",
                                          issued_by="gw", issued_at=utcnow()))
    await second.assign(0)
    await second.handle(req, 0, 0)
    await second.settle()
    (usage,) = group.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.finish_reason) == (4, 3, "cancelled")
    assert second.engine.generations == []


async def test_a_request_cancelled_in_the_backlog_is_not_billed_at_all() -> None:
    group = FakeGroup()
    worker = FakeWorker("w1", group)
    await worker.assign(0)
    req = request()
    from schemas.events import ControlAction, ControlEvent, utcnow

    worker.intake.on_control(ControlEvent(request_id=req.request_id, action=ControlAction.CANCEL, reason="gone",
                                          issued_by="gw", issued_at=utcnow()))
    await worker.handle(req, 0, 0)
    await worker.settle()
    assert group.usage == [] and worker.engine.generations == []
    (final,) = group.log.events(req.request_id)
    assert final.finish_reason == "cancelled"
    assert group.committed[P0].offset == 1
