"""Review of the model-free token deltas (``schemas.token_batch.Delta``): what the worker loses with the validation
its hot path no longer does. Driven with the real TokenSink over the fake producer, as in the worker."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncGenerator

from inference_workers.protocol import EngineDelta
from inference_workers.token_sink import TokenSink
from schemas.events import SamplingSpec, TokenEvent
from tests.fakes.engine import FakeEngine
from tests.fakes.kafka import FakeGroup
from tests.fakes.worker import make, pump, request, stop_made_workers
from tests.unit.worker.test_token_sink import TOPIC as TOKENS
from tests.unit.worker.test_token_sink import FakeProducer


class MalformedTextEngine(FakeEngine):
    """The fake engine, but the non-final deltas of the requests in ``bad`` carry a text that is not a str (an
    engine or detokenizer bug): ``TokenEvent`` validation rejected it in the request's own task before the change."""

    def __init__(self, bad: set[str], **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.bad = bad

    def generate(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingSpec, *,  # type: ignore[override]
                 priority: int = 0) -> AsyncGenerator[EngineDelta, None]:
        if request_id.split("#")[0] not in self.bad:
            return super().generate(request_id, prompt_token_ids, sampling, priority=priority)
        return self._malformed(request_id.split("#")[0], len(prompt_token_ids), sampling.max_tokens)

    async def _malformed(self, request_id: str, prompt: int, max_tokens: int) -> AsyncGenerator[EngineDelta, None]:
        gate = self._steps.setdefault(request_id, asyncio.Semaphore(0))
        for index in range(max_tokens):
            if self.auto:
                await asyncio.sleep(0)
            else:
                await gate.acquire()
            last = index == max_tokens - 1
            yield EngineDelta([100 + index], "" if last else None, "length" if last else None,  # type: ignore[arg-type]
                              prompt, 0)


def _finals(group: FakeGroup, request_id: str) -> list[TokenEvent]:
    return [s.event for s in group.log.records if s.event.request_id == request_id and s.event.is_final]


async def _ack_all(producer: FakeProducer) -> None:
    for ack in producer.acks:
        if not ack.done():
            ack.set_result(type("Meta", (), {"offset": 0})())
    await pump()


async def test_one_requests_malformed_delta_does_not_end_the_other_streams_of_its_record() -> None:
    """intake.py ``_delta`` builds the delta without validation, so a delta TokenEvent rejected (here text=None)
    reaches the sink and is packed with the other requests' deltas of the same engine step and reply partition.
    fastavro then refuses the whole record (token_sink.py ``_send``: TypeError 'must be string'), its shared
    delivery fails, and ``_delivered`` aborts *every* request it carries with token_delivery_failed, billed
    only what came before. Before the change the ValidationError was raised in the bad request's own task
    (``_generate``: generation_failed for it alone) and the good request's delta left in a record of its own."""
    group = FakeGroup()
    good, bad = request(max_tokens=3, reply=3), request(max_tokens=3, reply=3)
    worker = make("w1", group, MalformedTextEngine({bad.request_id}, auto=False))
    producer = FakeProducer()
    worker.intake._sink = TokenSink(producer, TOKENS)  # type: ignore[arg-type]
    try:
        await worker.assign(0, 1)
        await worker.handle(good, 0, 0)
        await worker.handle(bad, 1, 0)
        await pump()
        worker.engine.step(good.request_id)
        worker.engine.step(bad.request_id)  # one engine step, one reply partition: one record for both
        await pump()
        await _ack_all(producer)
        for _ in range(2):
            worker.engine.step(good.request_id)
            await pump()
            await _ack_all(producer)
        await worker.settle()
        (final_good,) = _finals(group, good.request_id)
        usage = final_good.usage
        ended = (final_good.finish_reason, final_good.error_code, usage.completion_tokens if usage else None)
        why = f"{final_good.error_code}: {final_good.error}"
        assert ended == ("length", None, 3), f"the good request's stream ended by another request's delta: {why}"
    finally:
        await stop_made_workers()
        gc.collect()  # now, not while pytest parses this file for the report (CPython 3.11.7 gh-106905)


async def test_a_stored_request_with_a_malformed_delta_still_gets_a_final() -> None:
    """A request that keeps a record (``store``): ``_relay_deltas`` appends the delta's text to ``job.text_parts``
    after the emit, which no longer validates it. The record then fails to encode, the request is aborted
    ("delivery") and ``_finalize`` joins the text parts for its StoredCompletion: ``"".join`` raises TypeError,
    which ``_run`` does not catch. No final is produced, its offset is never committed and its client waits for a
    stream that never ends. Before the change the ValidationError came before the append: one generation_failed
    final."""
    group = FakeGroup()
    stored = request(max_tokens=3, reply=3).model_copy(update={"store": True})
    worker = make("w1", group, MalformedTextEngine({stored.request_id}))
    producer = FakeProducer()
    worker.intake._sink = TokenSink(producer, TOKENS)  # type: ignore[arg-type]
    try:
        await worker.assign(0)
        await worker.handle(stored, 0, 0)
        await pump()
        await worker.settle()
        finals = _finals(group, stored.request_id)
        assert len(finals) == 1, "the request ended without a final (its task died in _finalize)"
        assert finals[0].finish_reason == "error"
    finally:
        await stop_made_workers()
        gc.collect()  # now, not while pytest parses this file for the report (CPython 3.11.7 gh-106905)
