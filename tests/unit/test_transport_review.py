"""Token transport v3 (packed token records), from an adversarial review of b1ad710 / bc1d44f. Each test fails
on the reviewed code, for the reason its docstring gives."""

from __future__ import annotations

import asyncio
from typing import Any

from aiokafka import ConsumerRecord, TopicPartition
from aiokafka.errors import KafkaTimeoutError

from inference_workers.emitter import Finalizer, Finished
from inference_workers.offsets import CommittedState, OffsetTracker
from inference_workers.token_sink import TokenSink
from producers.relay.demux import Relay
from runtime.settings import KafkaSettings
from schemas.codec import EventCodec, codec_for, schema_versions
from schemas.errors import DecodeError
from schemas.events import TokenEvent
from schemas.token_batch import pack
from tests.fakes.engine import FakeEngine
from tests.fakes.kafka import FakeClaims, FakeGroup, OneProducer, TxnProducerStub
from tests.fakes.worker import TOPIC, make, pump, request, stop_made_workers
from tests.helpers import token_event
from tests.unit.worker.test_token_sink import TOPIC as TOKENS
from tests.unit.worker.test_token_sink import FakeProducer

P0 = TopicPartition(TOPIC, 0)


def _v2_reader() -> EventCodec[TokenEvent]:
    """The codec of a gateway / processor / worker built before TokenEvent v3 (it knows v1 and v2 only)."""
    codec = EventCodec(TokenEvent)
    old = [v for v in schema_versions("token_event") if v.version <= 2]
    codec.latest = old[-1]
    codec._by_fingerprint = {v.fingerprint: v for v in old}
    return codec


class RawTxnProducer(TxnProducerStub):
    """Keeps the bytes it was given."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[tuple[str, bytes]] = []

    async def send(self, topic: str, value: bytes, key: bytes, partition: int | None = None,
                   headers: object = None) -> asyncio.Future[None]:
        self.sent.append((topic, value))
        return self.delivery()


async def test_with_record_version_2_a_requests_final_is_readable_by_the_readers_not_upgraded_yet() -> None:
    """The upgrade path (token_batch.py, DEVELOPERS.md): readers not upgraded yet keep working while workers run
    with KNS_WORKER__TOKEN_RECORD_VERSION=2. Only the TokenSink honours the setting (worker.py:134): the
    Finalizer encodes every final with ``codec.encode`` (emitter.py:279), i.e. the newest schema, v3, whose
    fingerprint a v2 reader does not know. Its relay fails the stream with UNDECODABLE_EVENT at its very end
    (every stream of the upgrade window ends in error), and an old worker's prefix reader skips the final on a
    takeover (``except DecodeError: continue``), so it regenerates a request that was already finished. The same
    holds for the safety prefilter's refusal/expired finals and the intake's undecodable-request final."""
    sink_producer = FakeProducer()
    sink = TokenSink(sink_producer, TOKENS, version=2)  # as worker.py builds it with the setting at 2
    delta = token_event("req-up", 0)
    await sink.emit(delta, 3, None)
    await pump(5)

    offsets = OffsetTracker()
    offsets.restore(P0, CommittedState(0, 0, frozenset()))
    offsets.taken(P0, 0)
    txn = RawTxnProducer()
    finalizer = Finalizer(OneProducer(txn), token_topic="tokens", usage_topic="usage",  # type: ignore[arg-type]
                          group_id="g", offsets=offsets, claims=FakeClaims(), batch_max=8, give_up_s=5,
                          token_version=2)  # as worker.py builds it with the setting at 2
    loop = asyncio.create_task(finalizer.run())
    final = token_event("req-up", 1, final=True)
    await finalizer.finish(Finished(final, None, 3, P0, 0, None, None))
    await finalizer.stop()
    await loop

    old = _v2_reader()
    assert sink_producer.records[0].version == 2  # the delta: readable by the old gateway
    (final_bytes,) = [value for topic, value in txn.sent if topic == "tokens"]
    try:
        back = old.decode(final_bytes)
    except DecodeError as exc:
        raise AssertionError(f"a v2 reader cannot read the request's final written during the upgrade: {exc}") from exc
    assert back.finish_reason == "stop"


class RefuseOnce(FakeProducer):
    """A producer whose next ``send`` is refused once (its buffer stayed full past request_timeout_ms)."""

    refuse_once: Exception | None = None

    async def send(self, topic: str, value: bytes, *, key: bytes | None, partition: int, headers: Any
                   ) -> asyncio.Future[object]:
        if self.gate is not None:
            await self.gate.wait()
        if self.refuse_once is not None:
            exc, self.refuse_once = self.refuse_once, None
            raise exc
        return await super().send(topic, value, key=key, partition=partition, headers=headers)


async def test_a_revoked_request_finalizing_does_not_end_the_other_streams_of_its_record() -> None:
    """A record's delivery future is shared by every request whose delta it carries (token_sink.py), and the
    intake awaits it with ``asyncio.gather(*job.in_flight)`` in ``_finalize`` (intake.py:538). A rebalance that
    moves a request partition cancels its jobs even while finalizing (``abort_partitions``): cancelling a task
    blocked in gather cancels the gathered futures themselves, i.e. the *shared* delivery future. Every other
    request in that record (here B, on a partition this worker keeps) then sees its delta as undelivered
    (``_delivered``: cancelled) and is aborted with cause "delivery": its stream ends in error
    (token_delivery_failed) and is billed 0 completion tokens, though its record was acknowledged. With one
    future per request (before v3) the cancel only touched the revoked request's own future."""
    group = FakeGroup()
    worker = make("w1", group, FakeEngine(auto=False))
    producer = FakeProducer()  # acks stay pending until the test gives them (the broker's latency)
    worker.intake._sink = TokenSink(producer, TOKENS)  # type: ignore[arg-type]
    try:
        await worker.assign(0, 1)
        a, b = request(max_tokens=2, reply=3), request(max_tokens=4, reply=3)
        await worker.handle(a, 0, 0)
        await worker.handle(b, 1, 0)
        await pump()
        worker.engine.step(a.request_id)
        worker.engine.step(b.request_id)  # one engine step: both deltas in one record
        await pump()
        assert [[e.request_id for e in r.events] for r in producer.records] == [[a.request_id, b.request_id]]
        worker.engine.step(a.request_id)  # A's last token: A finalizes, waiting for that record's ack
        await pump()
        assert worker.intake.jobs[a.request_id].finalizing
        await worker.assign(1)  # partition 0 moves to another worker; partition 1 (B's) stays here
        producer.acks[0].set_result(type("Meta", (), {"offset": 0})())  # the record was written all along
        await pump()
        ended = [s.event for s in group.log.records if s.event.request_id == b.request_id and s.event.is_final]
        assert not ended, f"B (kept partition) ended because A was revoked: {ended[0].error_code}: {ended[0].error}"
        for _ in range(3):
            worker.engine.step(b.request_id)
            await pump()
            for ack in producer.acks:
                if not ack.done():
                    ack.set_result(type("Meta", (), {"offset": 1})())
            await pump()
        await worker.settle()
        (final_b,) = [s.event for s in group.log.records if s.event.request_id == b.request_id and s.event.is_final]
        assert (final_b.finish_reason, final_b.error_code) == ("length", None)
    finally:
        await stop_made_workers()


async def test_a_delivery_future_cancelled_by_a_reader_does_not_stall_the_records_behind_it() -> None:
    """Follow-on of the shared future: ``_send`` settles a refused record with ``record.delivered.set_exception``
    without checking it is still pending (token_sink.py:106). When a reader cancelled it (a gather that was
    cancelled, as above) and the producer then refuses the record, ``set_exception`` raises InvalidStateError out
    of the sender task: the records queued behind it (other partitions, other requests) are never handed to the
    producer until some later emit starts a new sender, and if none comes (their requests finished generating and
    wait in ``_finalize`` for these very acks) they wait forever."""
    producer = RefuseOnce(gate=asyncio.Event())
    sink = TokenSink(producer, TOKENS)  # type: ignore[arg-type]
    stuck = await sink.emit(token_event("a", 0), 1, None)
    await pump(5)  # the first record is being handed to the producer (its buffer is full)
    behind = await sink.emit(token_event("b", 0), 2, None)
    stuck.cancel()  # what a cancelled asyncio.gather over a job's in-flight deliveries does to the shared future
    producer.refuse_once = KafkaTimeoutError()
    producer.gate.set()  # type: ignore[union-attr]
    await pump(10)
    sender = sink._sender
    try:
        assert [r.events[0].request_id for r in producer.records] == ["b"], (
            f"the record behind was never produced (sender: {sender!r})")
        producer.acks[0].set_result("meta")
        await pump(5)
        assert behind.done()
    finally:
        if sender is not None and sender.done() and not sender.cancelled():
            sender.exception()  # retrieved: no "never retrieved" log from a finalizer later in the session


def _record(offset: int, value: bytes, key: bytes | None = None) -> ConsumerRecord[bytes, bytes]:
    return ConsumerRecord(topic="tokens", partition=3, offset=offset, timestamp=0, timestamp_type=0, key=key,
                          value=value, checksum=None, serialized_key_size=0, serialized_value_size=len(value),
                          headers=[])


async def test_an_undecodable_packed_record_of_an_open_stream_ends_it_at_once() -> None:
    """demux.py's module docstring: "A record of an open stream that this gateway cannot decode is dead-lettered,
    and its stream ends at once with an error rather than waiting out a timeout". For a packed (unkeyed) record
    ``_undecodable`` now only dead-letters it: the streams whose deltas it carried keep waiting, and end only if
    and when a later event of theirs shows the seq gap (a worker that stops meanwhile leaves them to the idle
    timeout). The ids are in the record's bytes (``may_carry``), so the relay could tell which streams to end."""
    relay = Relay(KafkaSettings(), "tokens", 3)
    collector = relay.register("req-open")
    good = codec_for(TokenEvent).encode_dict(pack([token_event("req-other", 0), token_event("req-open", 0)]))
    corrupt = good[:-3]  # cut short: the last delta's text
    await relay._own._route(_record(0, corrupt))
    assert collector.finished, "the open stream whose delta the unreadable record carried was not ended"

