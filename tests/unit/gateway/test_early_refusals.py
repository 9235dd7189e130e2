"""Issue 37 M1: admission comes before the expensive work. A throttled key's requests are refused before their
prompt is rendered or tokenized (or a conversation's history read), and a key cannot have more requests being
prepared at once than it may have in flight."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from producers.gateway.early import EarlyRefusals
from producers.gateway.errors import ApiError
from producers.gateway.protocol import ChatCompletionRequest
from producers.gateway.service import ChatService
from runtime.settings import GatewaySettings, TierTable
from schemas.events import LimitOverrides, SamplingSpec
from tests.fakes.gateway import Clock, RecordingPublisher
from tests.fakes.tenancy import api_key, local_admission


class Relay:
    def register(self, request_id: str) -> Any:
        from producers.relay.collector import StreamCollector
        return StreamCollector(request_id)

    def unregister(self, request_id: str) -> None:
        pass


class Prompts:
    """A prompt builder that counts what it tokenizes (the work a refusal must not cost), and can be held."""

    def __init__(self) -> None:
        self.card = type("Card", (), {"served_name": "m"})()
        self.tokenized = 0
        self.hold: asyncio.Event | None = None

    async def tokens(self, messages: object) -> list[int]:
        self.tokenized += 1
        if self.hold is not None:
            await self.hold.wait()
        return [1, 2, 3]

    def sampling(self, body: object, n: int, **_: object) -> SamplingSpec:
        return SamplingSpec(max_tokens=8)


def service(clock: Clock) -> tuple[ChatService, Prompts]:
    prompts = Prompts()
    chat = ChatService(GatewaySettings(instance_id="gw"), prompts, RecordingPublisher(), Relay(), 0, "gw/1",  # type: ignore[arg-type]
                       admission=local_admission(), early=EarlyRefusals(TierTable.model_validate({}), clock=clock))
    return chat, prompts


BODY = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                             "stream": False})


async def test_a_key_refused_for_its_rate_is_refused_again_before_any_work_until_its_bucket_refills() -> None:
    clock = Clock()
    chat, prompts = service(clock)
    key = api_key(limits=LimitOverrides(requests_per_minute=1))
    await chat.accept(BODY, key, client_addr=None, traceparent="00-0-0-01")
    with pytest.raises(ApiError) as first:
        await chat.accept(BODY, key, client_addr=None, traceparent="00-0-0-01")
    assert first.value.status == 429 and prompts.tokenized == 2  # the refusal that taught it: worked once
    for _ in range(50):
        with pytest.raises(ApiError) as again:
            await chat.accept(BODY, key, client_addr=None, traceparent="00-0-0-01")
        assert (again.value.status, again.value.code) == (429, "rate_limit_exceeded")
        assert int(again.value.headers["retry-after-ms"]) <= int(first.value.headers["retry-after-ms"])  # type: ignore[index]
    assert prompts.tokenized == 2  # none of the 50 was tokenized
    other = api_key(key_id="k2", org_id="org2")
    await chat.accept(BODY, other, client_addr=None, traceparent="00-0-0-01")  # another key is not concerned
    clock.now += int(first.value.headers["retry-after-ms"]) / 1000  # type: ignore[index]
    with pytest.raises(ApiError):  # the local limiter's clock did not move: refused by admission, after the work
        await chat.accept(BODY, key, client_addr=None, traceparent="00-0-0-01")
    assert prompts.tokenized == 4
    await chat.drain()


async def test_a_budget_refusal_stands_until_the_orgs_record_changes_or_a_second_passes() -> None:
    clock = Clock()
    early = EarlyRefusals(TierTable.model_validate({}), clock=clock)
    key = api_key()
    early.remember(key, _refusal("budget", "org"))
    with pytest.raises(ApiError) as again:
        early.check(key)
    assert again.value.code == "insufficient_quota"
    early.check(api_key())  # the org's record again, with its budget raised: another record, served at once
    early.remember(key, _refusal("budget", "org"))
    clock.now += 1.0
    early.check(key)  # a second later, whatever the record


async def test_a_key_cannot_have_more_requests_being_prepared_than_it_may_have_in_flight() -> None:
    chat, prompts = service(Clock())
    key = api_key(limits=LimitOverrides(max_concurrent=2))
    prompts.hold = asyncio.Event()  # tokenizing takes a while (a big prompt; a turn waiting for its previous one)
    busy = [asyncio.ensure_future(chat.accept(BODY, key, client_addr=None, traceparent="00-0-0-01"))
            for _ in range(2)]
    await asyncio.sleep(0)
    with pytest.raises(ApiError) as third:
        await chat.accept(BODY, key, client_addr=None, traceparent="00-0-0-01")
    assert (third.value.status, third.value.type, prompts.tokenized) == (429, "requests", 2)
    prompts.hold.set()
    for accepted in await asyncio.gather(*busy):
        chat.close(accepted, "stop", stream=False)  # answered: their slots are free
    await chat.drain()
    await chat.accept(BODY, key, client_addr=None, traceparent="00-0-0-01")  # room again
    await chat.drain()


def _refusal(limit: str, scope: str) -> ApiError:
    from producers.gateway.admission import LimitRefusal
    from runtime.limiter import Refused, Window

    window = Window(1, 0, 1000, 1, 0, 1000)
    return LimitRefusal(Refused(limit, scope, -1, 1, window), 429, "spent", type="insufficient_quota",
                        code="insufficient_quota", headers={})


async def test_a_refusal_made_before_the_limiter_is_reported_to_the_abuse_detector_as_the_limiters_are() -> None:
    """A key hammering through its 429s is a signal (issue 36 item 3): the early refusals count as refusals."""
    from producers.gateway.admission import Admission
    from producers.gateway.local_limiter import LocalLimiter

    refused: list[str] = []
    admission = Admission(LocalLimiter(), LocalLimiter(), TierTable.model_validate({}),
                          on_refused=lambda key: refused.append(key.key_id))
    chat = ChatService(GatewaySettings(instance_id="gw"), Prompts(), RecordingPublisher(), Relay(), 0, "gw/1",  # type: ignore[arg-type]
                       admission=admission)
    key = api_key(limits=LimitOverrides(requests_per_minute=1))
    await chat.accept(BODY, key, client_addr=None, traceparent="00-0-0-01")
    for _ in range(5):
        with pytest.raises(ApiError):
            await chat.accept(BODY, key, client_addr=None, traceparent="00-0-0-01")
    assert refused == ["k"] * 5  # one by the limiter, four remembered
    await chat.drain()
