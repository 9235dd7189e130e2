"""The worker's token sink: the deltas of one engine step leave as one record per reply partition."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest

from inference_workers.synthetic import StepClock
from inference_workers.token_sink import TokenSink
from schemas.codec import codec_for, schema_versions
from schemas.events import TokenEvent
from tests.helpers import run_in_virtual_time, token_event

TOPIC = "tokens"


@dataclass
class Produced:
    partition: int
    key: bytes | None
    events: list[TokenEvent]
    version: int
    headers: Any


@dataclass
class FakeProducer:
    """aiokafka's ``send``: hands back a future the test settles (the broker's ack), or raises."""

    records: list[Produced] = field(default_factory=list)
    acks: list[asyncio.Future[object]] = field(default_factory=list)
    refuse: Exception | None = None
    #: held while set: ``send`` does not return (the producer's buffer is full)
    gate: asyncio.Event | None = None

    async def send(self, topic: str, value: bytes, *, key: bytes | None, partition: int, headers: Any
                   ) -> asyncio.Future[object]:
        assert topic == TOPIC
        if self.gate is not None:
            await self.gate.wait()
        if self.refuse is not None:
            raise self.refuse
        version = {v.fingerprint: v.version for v in schema_versions("token_event")}[value[2:10]]
        self.records.append(Produced(partition, key, codec_for(TokenEvent).decode(value).split(), version, headers))
        ack: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        self.acks.append(ack)
        return ack


def _sink(producer: FakeProducer, **kwargs: Any) -> TokenSink:
    return TokenSink(producer, TOPIC, **kwargs)  # type: ignore[arg-type]


async def _settled() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_one_steps_deltas_leave_as_one_record_per_partition() -> None:
    producer = FakeProducer()
    sink = _sink(producer)
    a0, b0, c0 = token_event("a", 0), token_event("b", 0), token_event("c", 0)
    deliveries = [await sink.emit(a0, 1, "tp-a"), await sink.emit(b0, 2, None), await sink.emit(c0, 1, None)]
    await _settled()
    assert [(r.partition, r.key, r.events, r.version) for r in producer.records] == [
        (1, None, [a0, c0.model_copy(update={"emitted_at_us": a0.emitted_at_us})], 3), (2, b"b", [b0], 3)]
    assert producer.records[0].headers is None  # many requests' trace contexts: none rides on a packed record
    assert deliveries[0] is deliveries[2] and deliveries[0] is not deliveries[1]
    producer.acks[0].set_result("meta-1")
    await _settled()
    assert deliveries[0].result() == "meta-1" and not deliveries[1].done()


async def test_the_next_step_goes_in_the_next_record_in_order() -> None:
    producer = FakeProducer()
    sink = _sink(producer)
    for seq in range(3):
        for rid in ("a", "b"):
            await sink.emit(token_event(rid, seq), 0, None)
        await _settled()
    assert [[(e.request_id, e.seq) for e in r.events] for r in producer.records] == [
        [("a", seq), ("b", seq)] for seq in range(3)]


async def test_a_slow_producer_gets_fewer_larger_records_in_order() -> None:
    producer = FakeProducer(gate=asyncio.Event())
    sink = _sink(producer)
    await sink.emit(token_event("a", 0), 0, None)
    await _settled()  # the first record is stuck in send()
    for seq in (1, 2):
        for rid in ("a", "b"):
            await sink.emit(token_event(rid, seq), 0, None)
        await _settled()
    producer.gate.set()  # type: ignore[union-attr]
    await _settled()
    assert [[(e.request_id, e.seq) for e in r.events] for r in producer.records] == [
        [("a", 0)], [("a", 1), ("b", 1), ("a", 2), ("b", 2)]]


async def test_a_record_holds_at_most_max_events() -> None:
    producer = FakeProducer()
    sink = _sink(producer, max_events=2)
    for rid in "abcde":
        await sink.emit(token_event(rid, 0), 0, None)
    await _settled()
    assert [len(r.events) for r in producer.records] == [2, 2, 1]


async def test_version_2_writes_one_request_per_record_for_old_readers() -> None:
    producer = FakeProducer()
    sink = _sink(producer, version=2)
    await sink.emit(token_event("a", 0), 0, "00-trace-span-01")
    await sink.emit(token_event("b", 0), 0, None)
    await _settled()
    assert [(r.key, r.version, len(r.events)) for r in producer.records] == [(b"a", 2, 1), (b"b", 2, 1)]
    assert producer.records[0].headers  # one request's record keeps its trace context


async def test_a_refused_or_failed_record_fails_every_delivery_it_carries() -> None:
    producer = FakeProducer(refuse=ValueError("too large"))
    sink = _sink(producer)
    first, second = await sink.emit(token_event("a", 0), 0, None), await sink.emit(token_event("b", 0), 0, None)
    await _settled()
    assert first is second and isinstance(first.exception(), ValueError)
    producer.refuse = None
    later = await sink.emit(token_event("a", 1), 0, None)
    await _settled()
    producer.acks[0].set_exception(ConnectionError("broker gone"))
    await _settled()
    assert isinstance(later.exception(), ConnectionError)


async def test_closing_hands_every_waiting_record_to_the_producer() -> None:
    producer = FakeProducer()
    sink = _sink(producer)
    await sink.emit(token_event("a", 0), 0, None)
    await sink.close()
    assert len(producer.records) == 1


async def test_a_cancelled_sender_cancels_what_it_did_not_hand_over() -> None:
    producer = FakeProducer(gate=asyncio.Event())
    sink = _sink(producer)
    stuck = await sink.emit(token_event("a", 0), 0, None)
    await _settled()
    waiting = await sink.emit(token_event("b", 0), 1, None)
    assert sink._sender is not None
    sink._sender.cancel()
    await _settled()
    assert stuck.cancelled() and waiting.cancelled()


def test_the_synthetic_engine_steps_every_request_on_one_tick() -> None:
    """Requests that started apart still get their tokens on the same ticks, as in a batching engine: one token
    per step, on consecutive steps, shared while both run. On a virtual clock: a late wake-up of a loaded machine
    cannot skip a grid point."""
    async def scenario() -> dict[str, list[int]]:
        clock, loop = StepClock(0.02), asyncio.get_running_loop()
        ticks: dict[str, list[int]] = {"a": [], "b": []}

        async def request(name: str, delay: float) -> None:
            await asyncio.sleep(delay)
            for _ in range(4):
                await clock.next()
                ticks[name].append(round(loop.time() / 0.02))  # the grid step

        await asyncio.gather(request("a", 0), request("b", 0.025))
        return ticks

    assert run_in_virtual_time(scenario) == {"a": [1, 2, 3, 4], "b": [2, 3, 4, 5]}


async def test_a_request_cancelled_on_a_tick_does_not_cancel_the_tick_for_others() -> None:
    clock = StepClock(0.02)
    other = asyncio.ensure_future(clock.next())
    doomed = asyncio.ensure_future(clock.next())
    await asyncio.sleep(0)
    doomed.cancel()
    await asyncio.wait_for(other, 1)
    with pytest.raises(asyncio.CancelledError):
        await doomed
