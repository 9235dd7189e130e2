"""Issue 10: a stream whose gateway is gone goes on while another gateway relays it (it resumed the stream: its
listener), and for the resume window after that; then it is cancelled, billed for what a live gateway could relay."""

from __future__ import annotations

import asyncio

from inference_workers.presence import GatewayPresence
from runtime.settings import RedisSettings
from tests.fakes.engine import FakeEngine
from tests.fakes.kafka import FakeGroup
from tests.fakes.worker import FakeWorker, request


class Redis:
    """The gateways' liveness keys (``mget``)."""

    def __init__(self, *alive: str) -> None:
        self.alive = set(alive)

    async def mget(self, keys: list[str]) -> list[str | None]:
        return ["1" if k.endswith(tuple(self.alive)) else None for k in keys]


class Streams:
    """The stream records' listeners (``runtime.streams.StreamDirectory.listeners``)."""

    def __init__(self) -> None:
        self.listener: dict[str, str] = {}

    async def listeners(self, request_ids: list[str]) -> list[str | None]:
        return [self.listener.get(r) for r in request_ids]


async def pump() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


async def test_a_resumed_stream_goes_on_while_its_listener_lives_and_is_billed_for_what_it_relayed() -> None:
    group = FakeGroup()
    worker = FakeWorker("w1", group, FakeEngine(auto=False))
    await worker.assign(0)
    req = request(max_tokens=100, gateway="gw/dead")
    await worker.handle(req, 0, 0)
    redis, streams = Redis("gw/dead"), Streams()
    presence = GatewayPresence(redis, RedisSettings(), worker.intake, check_every_s=1,  # type: ignore[arg-type]
                               grace_s=0, streams=streams)  # type: ignore[arg-type]
    worker.engine.step(req.request_id, 2)
    await pump()
    await presence.check()
    redis.alive = {"gw/resumer"}  # its gateway died; another one resumed the stream
    streams.listener[req.request_id] = "gw/resumer"
    worker.engine.step(req.request_id, 3)
    await pump()
    await presence.check()
    assert req.request_id in worker.intake.jobs  # relayed by the resumer: generation goes on
    relayed = worker.intake.jobs[req.request_id].tokens
    redis.alive = set()  # the resumer dies too, and nobody resumes it again
    worker.engine.step(req.request_id, 4)
    await pump()
    await presence.check()
    await worker.settle()
    (usage,) = group.usage
    assert usage.finish_reason == "cancelled" and usage.completion_tokens == relayed == 5


async def test_an_unattended_stream_waits_out_the_resume_window_before_it_is_cancelled() -> None:
    group = FakeGroup()
    worker = FakeWorker("w1", group, FakeEngine(auto=False))
    await worker.assign(0)
    req = request(max_tokens=100, gateway="gw/dead")
    await worker.handle(req, 0, 0)
    presence = GatewayPresence(Redis(), RedisSettings(), worker.intake, check_every_s=1,  # type: ignore[arg-type]
                               grace_s=3600, streams=Streams())  # type: ignore[arg-type]
    await presence.check()
    await presence.check()
    assert req.request_id in worker.intake.jobs and worker.intake.jobs[req.request_id].abort_cause is None
    await worker.assign()
