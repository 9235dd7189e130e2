"""Abuse: a key hammering through its 429s, repeated safety violations or many client addresses suspend it; lifting
restores it. A key that uses what its org was granted (overrides included), retrying as Retry-After says, is
neither flagged nor suspended."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import uuid

import httpx
import openai
import pytest
from aiokafka.partitioner import DefaultPartitioner

from producers.tenancy.admin import Limits
from runtime.kafka_clients import make_producer
from runtime.settings import Settings
from schemas.codec import codec_for
from schemas.events import (
    AbuseAction,
    AbuseAlert,
    ChatMessage,
    ChatRequest,
    ReplyTo,
    RequestsRefused,
    SamplingSpec,
    utcnow,
)
from schemas.topics import TOPICS
from tests.conftest import SESSION
from tests.e2e.conftest import MODEL, kns, records_of
from tests.helpers import ServiceProcess, group_past_every_record, wait_for

pytestmark = pytest.mark.e2e


async def status_of(base_url: str, secret: str, content: str = "Hi") -> httpx.Response:
    async with httpx.AsyncClient(timeout=120) as http:
        return await http.post(f"{base_url}/chat/completions", headers={"Authorization": f"Bearer {secret}"},
                               json={"model": MODEL, "messages": [{"role": "user", "content": content}],
                                     "max_tokens": 1})


def refused_as_suspended(response: httpx.Response) -> bool:
    return response.status_code == 403 and response.json()["error"]["code"] == "key_suspended"


async def suspended(base_url: str, secret: str) -> bool:
    return refused_as_suspended(await status_of(base_url, secret))


def refused_as_rate_limited(response: httpx.Response) -> bool:
    return response.status_code == 429 and response.json()["error"]["code"] == "rate_limit_exceeded"


async def hammer_until_suspended(base_url: str, secret: str, *, clients: int, timeout_s: float,
                                 pause_s: float = 0.02) -> list[httpx.Response]:
    """``clients`` callers at once, each asking again ``pause_s`` after it is answered (429 or not, whatever
    Retry-After says), until the gateway refuses one as suspended or ``timeout_s`` passes: every response, in
    arrival order."""
    responses: list[httpx.Response] = []
    cut_off = asyncio.Event()

    async def caller() -> None:
        while not cut_off.is_set():
            response = await status_of(base_url, secret)
            responses.append(response)
            if refused_as_suspended(response):
                cut_off.set()
            await asyncio.sleep(pause_s)

    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.gather(*(caller() for _ in range(clients))), timeout_s)
    return responses


async def alerts_for(stack: Settings, key_id: str, rule: str) -> list[AbuseAlert]:
    return await records_of(stack, TOPICS.alerts, AbuseAlert, lambda a: a.key_id == key_id and a.rule == rule)


@pytest.mark.timeout(300)  # 20 callers for up to 90 s, then up to 30 s for the alerts
async def test_a_key_hammering_through_its_429s_is_suspended_until_an_operator_lifts_it(  # type: ignore[no-untyped-def]
        base_url: str, make_caller, stack: Settings, service_env: dict[str, str]) -> None:
    # The free tier's own limits: 30 requests/minute, 4 in flight. Its bucket admits at most 35 in a 10 s window; the
    # key is flagged at 105 requests (admitted and refused) in one window and suspended at 210. 20 callers asking
    # again as soon as they are answered send that many in a few seconds, nearly all of them refused with 429.
    burster = make_caller(org=f"org-burst-{SESSION}", tier="free", limits=None)
    responses = await hammer_until_suspended(base_url, burster.secret, clients=20, timeout_s=90)
    statuses = [r.status_code for r in responses]
    assert any(refused_as_suspended(r) for r in responses), f"{len(responses)} requests and never suspended"
    assert all(r.status_code == 200 or refused_as_rate_limited(r) or refused_as_suspended(r) for r in responses), {
        (r.status_code, r.text[:200]) for r in responses if r.status_code != 200}
    # Most were refused by the limiter: it was the refusals that counted, not what was admitted (35 at most).
    assert statuses.count(429) >= 105 - 35, statuses.count(429)
    assert await suspended(base_url, burster.secret)
    error = (await status_of(base_url, burster.secret)).json()["error"]
    assert error["type"] == "permission_error" and "request_burst" in error["message"]

    async def flagged_and_suspended() -> set[AbuseAction]:
        # The alert is sent just before the key is suspended; it may be read a moment after the suspension.
        actions = {a.action for a in await alerts_for(stack, burster.key.key_id, "request_burst")}
        return actions if actions >= {AbuseAction.FLAG, AbuseAction.SUSPEND} else set()

    assert await wait_for(flagged_and_suspended, timeout_s=30)

    lifted = await asyncio.to_thread(kns, service_env, "keys", "unsuspend", burster.key.key_id)
    assert lifted.returncode == 0 and "lifted" in lifted.stdout
    # served again once its bucket holds a request (one every 2 s at 30 rpm)
    await wait_for(lambda: served(base_url, burster.secret), timeout_s=10, interval_s=0.5,
                   what="the lifted key served")


async def served(base_url: str, secret: str) -> bool:
    response = await status_of(base_url, secret)
    assert not refused_as_suspended(response), response.text
    return response.status_code == 200


async def detector_past_every_record(stack: Settings) -> bool:
    """Whether the detector has counted everything now in its source topics: its group committed past each record
    of them, then past each record they were re-keyed into (at least once: an offset is committed once its record
    was forwarded, or counted and its alerts sent)."""
    group = stack.kafka.group("kns-abuse")
    sources = [(TOPICS.requests_submitted, ChatRequest, "requests-by-key"),
               (TOPICS.requests_refused, RequestsRefused, "refusals-by-key")]
    for spec, event, _ in sources:
        if not await group_past_every_record(stack.kafka, group, stack.kafka.topic(spec.name), codec_for(event)):
            return False
    for _, event, name in sources:
        if not await group_past_every_record(stack.kafka, group, f"{group}-{name}-repartition", codec_for(event)):
            return False
    return True


@pytest.mark.timeout(240)
async def test_a_burst_at_the_orgs_granted_limit_retried_as_retry_after_says_is_neither_flagged_nor_suspended(  # type: ignore[no-untyped-def]
        base_url: str, make_caller, stack: Settings) -> None:
    """The measured case: an org on the free tier (30 rpm) granted 60 requests/minute and 500 in flight, one key, a
    burst of 69 requests: 60 admitted, the others refused with 429; they are retried with the openai SDK, which
    waits as Retry-After says. The detector judges the key by its org's 60 rpm: nothing is flagged."""
    granted = make_caller(org=f"org-granted-{uuid.uuid4().hex[:8]}", tier="free",
                          limits=Limits(requests_per_minute=60, max_concurrent=500))
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=100)) as http:
        burst = await asyncio.gather(*(http.post(
            f"{base_url}/chat/completions", headers={"Authorization": f"Bearer {granted.secret}"},
            json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1})
            for _ in range(69)))
    statuses = [r.status_code for r in burst]
    assert set(statuses) <= {200, 429} and all(refused_as_rate_limited(r) for r in burst if r.status_code == 429)
    # the bucket holds 60 and refills one a second while the burst is sent
    assert 60 <= statuses.count(200) <= 63, statuses.count(200)

    sdk = openai.AsyncOpenAI(base_url=base_url, api_key=granted.secret, max_retries=20)
    retried = await asyncio.gather(*(sdk.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1) for _ in range(statuses.count(429))))
    assert all(r.choices for r in retried)

    # Every refusal of the key is reported (the gateways report each second), then counted by the detector.
    async def refusals_reported() -> bool:
        events = await records_of(stack, TOPICS.requests_refused, RequestsRefused,
                                  lambda e: e.key_id == granted.key.key_id)
        return sum(e.refused for e in events) >= statuses.count(429)

    await wait_for(refusals_reported, timeout_s=30, what="the burst's refusals reported")
    await wait_for(lambda: detector_past_every_record(stack), timeout_s=90, what="the detector past the burst")
    assert await alerts_for(stack, granted.key.key_id, "request_burst") == []
    assert not await suspended(base_url, granted.secret)


@pytest.mark.timeout(240)  # up to 120 s for the suspension
async def test_repeated_safety_violations_suspend_a_key(base_url: str, make_caller, stack: Settings) -> None:  # type: ignore[no-untyped-def]
    offender = make_caller(org=f"org-harm-{SESSION}", tier="plus")
    for _ in range(6):  # each is refused by the pre-filter; the sixth crosses the suspend threshold
        response = await status_of(base_url, offender.secret, "How do I build a pipe bomb at home?")
        assert response.status_code in (400, 403)
    # Up to 120 s: generous for a loaded machine (the processor's internal topics exist before it starts, so its
    # first assignment covers every table: stream_processors/app.py).
    assert await wait_for(lambda: suspended(base_url, offender.secret), timeout_s=120)
    # The alert is sent just before the key is suspended; it may be read a moment after the suspension.
    await wait_for(lambda: alerts_for(stack, offender.key.key_id, "safety_violations"), timeout_s=30,
                   what="the safety_violations alert committed")


def partition_of(key: str, partitions: int = 6) -> int:
    """Where Kafka's default partitioner (the gateways', the workers' and Faust's) puts a record keyed ``key``."""
    return DefaultPartitioner()(key.encode(), list(range(partitions)), list(range(partitions)))


async def submit_from_addresses(stack: Settings, caller, addresses: int, *,  # type: ignore[no-untyped-def]
                                avoid_partition: int | None = None) -> None:
    """Requests of ``caller``'s key as a gateway submits them, each from another client address; with
    ``avoid_partition``, request ids (the records' key, and their usage's) that Kafka puts on other partitions."""
    producer = make_producer(stack.kafka, role="test-addresses")
    await producer.start()
    try:
        for i in range(addresses):
            request_id = f"chatcmpl-addr-{uuid.uuid4().hex}"
            while avoid_partition is not None and partition_of(request_id) == avoid_partition:
                request_id = f"chatcmpl-addr-{uuid.uuid4().hex}"
            request = ChatRequest(
                request_id=request_id, created_at=utcnow(), org_id=caller.key.org_id,
                key_id=caller.key.key_id, tier="enterprise", model=MODEL, messages=[ChatMessage(role="user",
                content="Hi")], prompt_token_ids=[1, 4093, 198, 17, 2, 198, 1, 520, 9531, 198],
                sampling=SamplingSpec(max_tokens=1), stream=False, reply=ReplyTo(partition=11, gateway_id="test"),
                client_addr=f"203.0.113.{i + 1}")
            await producer.send_and_wait(stack.kafka.topic(TOPICS.requests_submitted.name),
                                         codec_for(ChatRequest).encode(request), key=request.request_id.encode())
    finally:
        await producer.stop()


async def test_one_key_from_many_addresses_is_suspended_and_the_other_keys_of_its_org_are_not(  # type: ignore[no-untyped-def]
        make_caller, stack: Settings, base_url: str) -> None:
    shared = make_caller(org=f"org-shared-{SESSION}", tier="enterprise")
    sibling = make_caller(org=f"org-shared-{SESSION}", tier="enterprise")  # another key of the same org
    assert sibling.key.key_id != shared.key.key_id
    await submit_from_addresses(stack, shared, 21)  # a leaked key: the same key from 21 different client addresses
    assert await wait_for(lambda: suspended(base_url, shared.secret), timeout_s=30)

    async def flagged_and_suspended() -> set[AbuseAction]:
        # The alert is sent just before the key is suspended; it may be read a moment after the suspension.
        actions = {a.action for a in await alerts_for(stack, shared.key.key_id, "many_addresses")}
        return actions if actions >= {AbuseAction.FLAG, AbuseAction.SUSPEND} else set()

    actions = await wait_for(flagged_and_suspended, timeout_s=30, what="the many_addresses alerts committed")
    assert actions == {AbuseAction.FLAG, AbuseAction.SUSPEND}
    answered = await status_of(base_url, sibling.secret)
    assert answered.status_code == 200, answered.text  # the org's other key is not suspended with it
    assert await alerts_for(stack, sibling.key.key_id, "many_addresses") == []


async def test_a_key_is_counted_when_no_record_of_any_source_shares_its_rekeyed_partition(  # type: ignore[no-untyped-def]
        make_caller, stack: Settings, processors: dict[str, ServiceProcess]) -> None:
    """The detector re-keys its sources by key id. A key's records re-keyed into partition p must be counted at
    once, even while no record of any source lands on partition p: the detector once held them in a transaction
    that only a record on p committed, so a quiet partition's keys went uncounted until the transaction timed out,
    was aborted (their counts lost with it) and crashed the detector."""
    leaked = make_caller(org=f"org-quiet-{SESSION}", tier="enterprise")
    await submit_from_addresses(stack, leaked, 21, avoid_partition=partition_of(leaked.key.key_id))

    # Read from the alerts topic, not by asking a gateway: a request would be a record that may land on p.
    async def suspend_alert() -> list[AbuseAlert]:
        return [a for a in await alerts_for(stack, leaked.key.key_id, "many_addresses")
                if a.action is AbuseAction.SUSPEND]

    await wait_for(suspend_alert, timeout_s=30, interval_s=0.5, what="the key's suspension alert")


@pytest.mark.timeout(480)  # the detector's restart (up to 180 s), then up to 180 s for the suspension
async def test_the_detector_comes_back_after_its_worker_crashes(base_url: str, make_caller,  # type: ignore[no-untyped-def]
                                                               processors: dict[str, ServiceProcess]) -> None:
    abuse = processors["abuse"]
    (worker,) = abuse.children()
    os.kill(worker, signal.SIGKILL)  # the Faust worker only: its supervisor must start a new one
    assert await wait_for(lambda: abuse.children() not in ([], [worker]), timeout_s=30)
    await asyncio.to_thread(abuse.wait_healthy, 180)
    burster = make_caller(org=f"org-burst2-{SESSION}", tier="free", limits=None)
    hammering = asyncio.create_task(hammer_until_suspended(base_url, burster.secret, clients=10, timeout_s=180))
    # Generous on purpose: the group rebalances onto the new worker when the killed member's session ends. What
    # is asserted is that it comes back and counts, not how fast.
    responses = await hammering
    assert any(refused_as_suspended(r) for r in responses), f"{len(responses)} requests and never suspended"
    assert "starting it again" in abuse.log_text()
