"""The intake under failures of what it depends on (the fakes stand in for Kafka and Redis): queue deadlines, a
lost delta, a Redis outage while claiming, an undecodable record, a gateway that is gone."""

from __future__ import annotations

import asyncio

import pytest
from aiokafka import TopicPartition
from aiokafka.errors import KafkaTimeoutError
from redis.exceptions import ConnectionError as RedisConnectionError

from inference_workers.intake import Job
from inference_workers.offsets import Taken
from inference_workers.presence import GatewayPresence
from schemas.errors import DecodeError, FatalError, RetryLater
from schemas.events import ChatRequest, ControlAction, ControlEvent, utcnow
from schemas.headers import request_headers
from tests.fakes.engine import FakeEngine
from tests.fakes.kafka import FakeGroup, FakeSink, ReplyLog, Sent
from tests.fakes.worker import TOPIC, FakeWorker, pump, record, request

P0 = TopicPartition(TOPIC, 0)


async def test_a_request_past_its_queue_deadline_is_not_generated_nor_billed() -> None:
    """Defect 3: a request older than any client would wait for used to be generated to max_tokens for nobody."""
    group = FakeGroup()
    worker = FakeWorker("w1", group)
    await worker.assign(0)
    req = request(deadline_in_s=-1)
    await worker.handle(req, 0, 0)
    await worker.settle()
    assert worker.engine.generations == [] and group.usage == []
    (final,) = group.log.events(req.request_id)
    assert (final.finish_reason, final.error_code) == ("error", "queue_deadline_exceeded")
    assert group.committed[P0].offset == 1


async def test_a_lost_delta_ends_the_stream_in_error_and_bills_only_what_reached_the_gateway() -> None:
    """Defect 8: a failed delta send was only logged; the client silently missed text."""
    group = FakeGroup()
    worker = FakeWorker("w1", group, FakeEngine(auto=False))
    await worker.assign(0)
    req = request(max_tokens=10)
    worker.intake._sink.refuse_at = {3}  # type: ignore[attr-defined]
    await worker.handle(req, 0, 0)
    worker.engine.step(req.request_id, 10)
    await worker.settle()
    (usage,) = group.usage
    assert usage.completion_tokens == 3 and usage.finish_reason == "error"
    text, stream = group.log.client_view(req.request_id)
    assert stream.final is None and stream.error is not None and "missing" in stream.error  # never a silent gap
    assert text.count(" t") == 3
    assert worker.engine.generation(req.request_id).aborted  # generation stopped early, not run to the end


async def test_redis_down_while_claiming_defers_the_record_and_loses_nothing() -> None:
    """Defect 7: a Redis error from the claim ended the worker's consumer task (and the worker)."""
    group = FakeGroup()
    worker = FakeWorker("w1", group)
    await worker.assign(0)
    req = request()
    group.claims.fail_with = RedisConnectionError("Redis is restarting")
    with pytest.raises(RetryLater):
        await worker.handle(req, 0, 0)
    assert worker.offsets.classify(P0, 0) is Taken.NEW  # handed back, fetched again
    assert worker.intake.degraded and "Redis" in worker.intake.degraded
    group.claims.fail_with = None
    await worker.handle(req, 0, 0)
    await worker.settle()
    assert worker.intake.degraded is None
    assert [u.request_id for u in group.usage] == [req.request_id]


async def test_an_undecodable_request_is_answered_at_once_from_its_headers() -> None:
    """Defect 11: a record whose schema a worker does not know was skipped silently: the client waited 120 s."""
    group = FakeGroup()
    worker = FakeWorker("w1", group)
    await worker.assign(0)
    raw = record(0, 0, b"\xc3\x01" + b"\x00" * 8 + b"body", headers=request_headers("chatcmpl-x", 5))
    await worker.intake.undecodable(raw, DecodeError("unknown schema fingerprint 00"))
    for _ in range(5):
        await asyncio.sleep(0)
    (final,) = group.log.events("chatcmpl-x")
    assert (final.finish_reason, final.error_code) == ("error", "undecodable_request")
    assert group.log.records[0].partition == 5 and group.usage == []
    assert group.committed[P0].offset == 1


async def test_the_streams_of_a_gateway_that_is_gone_are_cancelled_and_billed_for_what_reached_it() -> None:
    """Defect 3: when a gateway died its relay's tokens went to nobody, generated to max_tokens and billed."""

    class Redis:
        alive = {"gw/alive", "gw/dead"}

        async def mget(self, keys: list[str]) -> list[str | None]:
            return ["1" if k.endswith(tuple(self.alive)) else None for k in keys]

    from runtime.settings import RedisSettings

    group = FakeGroup()
    worker = FakeWorker("w1", group, FakeEngine(auto=False))
    await worker.assign(0)
    gone, kept = request(max_tokens=100, gateway="gw/dead"), request(max_tokens=100, gateway="gw/alive")
    await worker.handle(gone, 0, 0)
    await worker.handle(kept, 0, 1)
    redis = Redis()
    presence = GatewayPresence(redis, RedisSettings(), worker.intake, check_every_s=1, grace_s=0)  # type: ignore[arg-type]
    worker.engine.step(gone.request_id, 2)
    for _ in range(10):
        await asyncio.sleep(0)
    await presence.check()  # both gateways alive: the 2 tokens may have reached the client
    redis.alive.discard("gw/dead")  # the gateway dies
    worker.engine.step(gone.request_id, 3)  # generated for nobody
    for _ in range(10):
        await asyncio.sleep(0)
    await presence.check()
    await asyncio.gather(*(j.task for j in list(worker.intake.jobs.values()) if j.task and
                           j.request.request_id == gone.request_id), return_exceptions=True)
    assert [u.finish_reason for u in group.usage] == ["cancelled"]
    assert group.usage[0].completion_tokens == 2  # what the gateway could have delivered, not the 5 generated
    assert kept.request_id in worker.intake.jobs
    await worker.assign()


class AckOnCueSink(FakeSink):
    """Each delta is acknowledged, or fails, when the test says. It is on the log at once (the broker has it, and
    a failure is an answer lost), or with ``lands_on_ack`` only once acknowledged (a failed one is really missing).
    As TokenSink.emit, nothing is awaited: the event is queued and counted in one step (no cancel between)."""

    def __init__(self, log: ReplyLog, *, lands_on_ack: bool = False) -> None:
        super().__init__(log)
        self.lands_on_ack = lands_on_ack
        self.acks: dict[int, asyncio.Future[object]] = {}

    async def emit(self, event, partition, traceparent):  # type: ignore[no-untyped-def]
        sent = Sent(event.event(), partition)
        ack = self.acks[event.token_offset] = asyncio.get_running_loop().create_future()
        if self.lands_on_ack:
            ack.add_done_callback(lambda done: None if done.exception() else self.log.records.append(sent))
        else:
            self.log.records.append(sent)
        return ack

    def ack(self, *token_offsets: int) -> None:
        for offset in token_offsets:
            self.acks[offset].set_result(type("Meta", (), {"offset": offset})())

    def fail(self, token_offset: int) -> None:
        self.acks[token_offset].set_exception(KafkaTimeoutError("no answer within request_timeout_ms"))


async def streaming(tokens: int, *, lands_on_ack: bool = False) -> tuple[FakeGroup, FakeWorker, ChatRequest,
                                                                         AckOnCueSink]:
    """A request whose engine has produced ``tokens`` tokens, every delta emitted and none acknowledged yet."""
    group = FakeGroup()
    worker = FakeWorker("w1", group, FakeEngine(auto=False))
    await worker.assign(0)
    req = request(max_tokens=10)
    sink = worker.intake._sink = AckOnCueSink(group.log, lands_on_ack=lands_on_ack)  # type: ignore[assignment]
    await worker.handle(req, 0, 0)
    worker.engine.step(req.request_id, tokens)
    await pump()
    return group, worker, req, sink


async def test_a_delta_appended_whose_ack_was_lost_is_billed_as_received() -> None:
    """restart-broker (CI, once): the broker went away with a token record appended and unacknowledged. The worker
    billed the acknowledged tokens (32); the client's relay read the record from the log and received 33. A
    failed delivery does not say the record is missing: what the client can have is what the log holds."""
    group, worker, req, sink = await streaming(10)
    sink.fail(3)
    sink.ack(*(offset for offset in sink.acks if offset != 3))
    await worker.settle()
    _, stream = group.log.client_view(req.request_id)
    (usage,) = group.usage
    assert stream.final is not None and stream.final.error_code == "token_delivery_failed"
    assert stream.final.usage is not None and stream.final.usage.completion_tokens == stream.tokens
    assert usage.completion_tokens == stream.tokens >= 4, (
        f"billed {usage.completion_tokens}; the client received {stream.tokens}")


async def test_a_client_that_hung_up_is_billed_what_the_log_holds_though_a_delivery_then_failed() -> None:
    """The client hangs up having received 2 tokens (its gateway's cancel says so), then a delta's ack fails while the
    worker waits for its acks; the broker had appended it all the same (its answer was lost). A stopped stream whose
    connection ended is billed what the log holds: any client of the stream can read it (beyond the 2: what was in
    flight at the hang-up). (Before the review of the read-back: the failure turned the outcome into an error
    and billed 5, what was emitted; before issue 37 C1: billed the 2 the cancel said.)"""
    group, worker, req, sink = await streaming(5)
    sink.ack(0, 1)
    await pump()
    worker.intake.on_control(ControlEvent(request_id=req.request_id, action=ControlAction.CANCEL, reason="gone",
                                          issued_by="gw/1", issued_at=utcnow(), delivered_tokens=2))
    await pump()
    sink.ack(2, 4)
    sink.fail(3)
    await worker.settle()
    (usage,) = group.usage
    _, stream = group.log.client_view(req.request_id)
    assert (usage.completion_tokens, usage.finish_reason, stream.tokens) == (5, "cancelled", 5)


async def test_an_unattended_stream_whose_delivery_failed_is_billed_no_more_than_the_log_holds() -> None:
    """Second review: an unattended cancel caps the bill at what was emitted while a gateway was last seen (5, in
    flight then); a delta then failed and never landed, so a client resuming gets 2. Billed 5 for 2 tokens."""
    group, worker, req, sink = await streaming(5, lands_on_ack=True)
    listeners = worker.intake.jobs[req.request_id].listeners
    listeners.seen({req.reply.gateway_id: True}, 5)  # a presence check sees its gateway alive, 5 tokens out
    listeners.seen({req.reply.gateway_id: False}, 5)  # the next one finds it gone
    assert worker.intake.cancel_unattended(req.request_id)
    await pump()
    sink.ack(0, 1)
    sink.fail(2)
    sink.ack(3, 4)
    await worker.settle()
    _, stream = group.log.client_view(req.request_id)
    (usage,) = group.usage
    assert stream.tokens == 2 and usage.completion_tokens == 2, f"billed {usage.completion_tokens}"


class OneAtATimeFailingReader:
    """PrefixReader's shape while the broker is away: one read at a time, each failing after its timeout."""

    def __init__(self, read_s: float) -> None:
        self._lock = asyncio.Lock()
        self._read_s = read_s
        self.reads: list[str] = []

    async def read(self, request, first_offset):  # type: ignore[no-untyped-def]
        async with self._lock:
            self.reads.append(request.request_id)
            await asyncio.sleep(self._read_s)
            raise KafkaTimeoutError("broker away")


async def test_a_read_back_queued_behind_others_reads_again_before_the_worker_gives_up() -> None:
    """Second review: the give-up clock ran from the first try, so a read-back that waited its turn behind two
    others' failed reads gave up after its own first read: the worker stopped on a single failure of it."""
    worker = FakeWorker("w1", FakeGroup())
    reader = worker.intake._prefix = OneAtATimeFailingReader(0.15)  # type: ignore[assignment]
    worker.intake._give_up_s = 0.2
    jobs = [Job(request(), P0, i, 1, None, 0.0, utcnow()) for i in range(3)]
    await asyncio.gather(*(worker.intake._read_prefix(job) for job in jobs), return_exceptions=True)
    assert isinstance(worker.intake.fatal.exception(), FatalError)  # Kafka stayed away: the worker stops
    reads = [reader.reads.count(job.request.request_id) for job in jobs]
    assert min(reads) >= 2, f"reads per read-back: {reads}"
