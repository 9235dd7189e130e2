"""Adversarial review of a14b434 (runs_unattended), 4d07ac1 (ENGINE_FAILED), 75a43f4 (chaos audit: streams in the
token log), 3f16486 (a usage report's read cost) and 46c094b (the relay's id filter). Each test is a defect found
(it failed as a strict xfail stating the defect, its consequence and the line, 97978eb) and passes since its fix."""

from __future__ import annotations

from redis.exceptions import ConnectionError as RedisConnectionError

from bench.chaos.audit import judge
from inference_workers.presence import GatewayPresence
from producers.gateway.admission import Admission
from producers.gateway.errors import ApiError
from producers.gateway.local_limiter import LocalLimiter
from producers.gateway.routes.usage import MAX_RANGE, read_cost
from runtime.limiter import ReadDecision
from runtime.settings import RedisSettings, TierTable
from schemas.events import Turn
from tests.fakes.engine import FakeEngine
from tests.fakes.gateway import Clock
from tests.fakes.kafka import FakeGroup
from tests.fakes.tenancy import api_key
from tests.fakes.worker import FakeWorker, request
from tests.unit.test_chaos_audit import healthy
from tests.unit.worker.test_presence_resume import Clock as WorkerClock
from tests.unit.worker.test_presence_resume import Redis, emitted

TIERS = TierTable.model_validate({})


async def test_a_non_streamed_unstored_response_is_cancelled_for_nobody_when_its_gateway_dies() -> None:
    group, clock = FakeGroup(), WorkerClock()
    worker = FakeWorker("w1", group, FakeEngine(auto=False))
    worker.intake.clock = clock
    await worker.assign(0)
    unstored = request(max_tokens=8, gateway="gw/a").model_copy(
        update={"stream": False, "turn": Turn(api="responses", input_count=1, store=False)})
    await worker.handle(unstored, 0, 0)
    redis = Redis("gw/a")
    presence = GatewayPresence(redis, RedisSettings(), worker.intake, check_every_s=1,  # type: ignore[arg-type]
                               grace_s=30, clock=clock)
    worker.engine.step(unstored.request_id, 3)
    await emitted(group, unstored, 3)
    await presence.check()
    redis.alive = set()  # its gateway dies, and its client's connection with it
    await presence.check()
    clock.now += 60
    await presence.check()  # past the grace for a gateway gone
    worker.engine.step(unstored.request_id, 5)
    await worker.settle()
    (usage,) = group.usage
    assert (usage.finish_reason, usage.completion_tokens) == ("cancelled", 3)


class _RedisDown:
    async def admit_read(self, **_kwargs: object) -> ReadDecision:
        raise RedisConnectionError("Redis is down")


async def test_with_redis_down_a_long_usage_report_is_admitted_once_its_retry_after_has_passed() -> None:
    clock = Clock()
    admission = Admission(_RedisDown(), LocalLimiter(share=0.25, clock=clock), TIERS)  # type: ignore[arg-type]
    key = api_key(tier="free")  # 30 reads a minute; this gateway's local share: 7
    cost = read_cost(MAX_RANGE)  # 14
    try:
        await admission.admit_read(key, cost=cost)  # full buckets: admitted at once, or told how long to wait
    except ApiError as refused:
        wait_ms = int((refused.headers or {})["retry-after-ms"])
        clock.now += wait_ms / 1000 + 60  # its retry-after, and a whole minute more: every bucket is full again
        await admission.admit_read(key, cost=cost)


def test_the_chaos_audit_fails_a_run_whose_token_log_holds_fewer_tokens_than_a_client_received() -> None:
    evidence = healthy()
    request_id = evidence.streams[1].request_id or ""
    evidence.tokens[request_id] = [e for e in evidence.tokens[request_id] if e.finish_reason is not None]
    table = judge(evidence)
    assert not table.goals_met, "a token log that lost every delta of a received stream passed the audit"
