"""Abuse: a burst, repeated safety violations or many client addresses suspend a key; lifting restores it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import uuid

import httpx
import pytest

from runtime.kafka_clients import make_producer
from runtime.settings import Settings
from schemas.codec import codec_for
from schemas.events import AbuseAction, AbuseAlert, ChatMessage, ChatRequest, ReplyTo, SamplingSpec, utcnow
from schemas.topics import TOPICS
from tests.conftest import SESSION
from tests.e2e.conftest import MODEL, kns, records_of
from tests.helpers import ServiceProcess, wait_for

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


async def burst_until_refused(base_url: str, secret: str, *, clients: int, timeout_s: float) -> list[httpx.Response]:
    """``clients`` callers at once, each asking again as soon as it is answered, until the gateway refuses one
    (the suspension reached it) or ``timeout_s`` passes (it never did): every response, in arrival order."""
    responses: list[httpx.Response] = []
    refused = asyncio.Event()

    async def caller() -> None:
        while not refused.is_set():
            response = await status_of(base_url, secret)
            responses.append(response)
            if response.status_code != 200:
                refused.set()

    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.gather(*(caller() for _ in range(clients))), timeout_s)
    return responses


async def alerts_for(stack: Settings, key_id: str, rule: str) -> list[AbuseAlert]:
    return await records_of(stack, TOPICS.alerts, AbuseAlert, lambda a: a.key_id == key_id and a.rule == rule)


@pytest.mark.timeout(300)  # a burst of 60 callers for up to 90 s, then up to 30 s for the alerts
async def test_a_burst_suspends_a_free_key_until_an_operator_lifts_it(base_url: str, make_caller, stack: Settings,  # type: ignore[no-untyped-def]
                                                                      service_env: dict[str, str]) -> None:
    burster = make_caller(org=f"org-burst-{SESSION}", tier="free")
    # Free tier: 30 requests/minute, suspended at 30 in a 10 s window. 60 callers asking back to back send at least
    # 60 in a few seconds, so one window holds 30 of them even if the burst straddles a window boundary; they go on
    # until the detector's suspension cuts them off.
    responses = await burst_until_refused(base_url, burster.secret, clients=60, timeout_s=90)
    statuses = [r.status_code for r in responses]
    refusals = [r for r in responses if r.status_code != 200]
    assert refusals, f"all {len(responses)} requests of the burst were answered: it was never cut off"
    assert all(refused_as_suspended(r) for r in refusals), {(r.status_code, r.text[:200]) for r in refusals}
    # Only requests the gateway accepted reach the detector: the suspension needed 30 of them in one window.
    assert statuses.count(200) >= 30
    assert await suspended(base_url, burster.secret)
    error = (await status_of(base_url, burster.secret)).json()["error"]
    assert error["type"] == "permission_error" and "request_burst" in error["message"]

    async def flagged_and_suspended() -> set[AbuseAction]:
        # The key is suspended before the detector's transaction, which holds the alerts, commits.
        actions = {a.action for a in await alerts_for(stack, burster.key.key_id, "request_burst")}
        return actions if actions >= {AbuseAction.FLAG, AbuseAction.SUSPEND} else set()

    assert await wait_for(flagged_and_suspended, timeout_s=30)

    lifted = await asyncio.to_thread(kns, service_env, "keys", "unsuspend", burster.key.key_id)
    assert lifted.returncode == 0 and "lifted" in lifted.stdout
    assert (await status_of(base_url, burster.secret)).status_code == 200


@pytest.mark.timeout(240)  # up to 120 s for the suspension
async def test_repeated_safety_violations_suspend_a_key(base_url: str, make_caller, stack: Settings) -> None:  # type: ignore[no-untyped-def]
    offender = make_caller(org=f"org-harm-{SESSION}", tier="plus")
    for _ in range(6):  # each is refused by the pre-filter; the sixth crosses the suspend threshold
        response = await status_of(base_url, offender.secret, "How do I build a pipe bomb at home?")
        assert response.status_code in (400, 403)
    # Up to 120 s: generous for a loaded machine (the processor's internal topics exist before it starts, so its
    # first assignment covers every table: stream_processors/app.py).
    assert await wait_for(lambda: suspended(base_url, offender.secret), timeout_s=120)
    # The key is suspended before the detector's transaction, which holds the alerts, commits.
    await wait_for(lambda: alerts_for(stack, offender.key.key_id, "safety_violations"), timeout_s=30,
                   what="the safety_violations alert committed")


async def test_one_key_from_many_addresses_is_suspended_and_the_other_keys_of_its_org_are_not(  # type: ignore[no-untyped-def]
        make_caller, stack: Settings, base_url: str) -> None:
    shared = make_caller(org=f"org-shared-{SESSION}", tier="enterprise")
    sibling = make_caller(org=f"org-shared-{SESSION}", tier="enterprise")  # another key of the same org
    assert sibling.key.key_id != shared.key.key_id
    producer = make_producer(stack.kafka, role="test-addresses")
    await producer.start()
    try:
        for i in range(21):  # a leaked key: the same key from 21 different client addresses
            request = ChatRequest(
                request_id=f"chatcmpl-addr-{uuid.uuid4().hex}", created_at=utcnow(), org_id=shared.key.org_id,
                key_id=shared.key.key_id, tier="enterprise", model=MODEL, messages=[ChatMessage(role="user",
                content="Hi")], prompt_token_ids=[1, 4093, 198, 17, 2, 198, 1, 520, 9531, 198],
                sampling=SamplingSpec(max_tokens=1), stream=False, reply=ReplyTo(partition=11, gateway_id="test"),
                client_addr=f"203.0.113.{i + 1}")
            await producer.send_and_wait(stack.kafka.topic(TOPICS.requests_submitted.name),
                                         codec_for(ChatRequest).encode(request), key=request.request_id.encode())
    finally:
        await producer.stop()
    assert await wait_for(lambda: suspended(base_url, shared.secret), timeout_s=30)

    async def flagged_and_suspended() -> set[AbuseAction]:
        # The key is suspended before the detector's transaction, which holds the alerts, commits.
        actions = {a.action for a in await alerts_for(stack, shared.key.key_id, "many_addresses")}
        return actions if actions >= {AbuseAction.FLAG, AbuseAction.SUSPEND} else set()

    actions = await wait_for(flagged_and_suspended, timeout_s=30, what="the many_addresses alerts committed")
    assert actions == {AbuseAction.FLAG, AbuseAction.SUSPEND}
    answered = await status_of(base_url, sibling.secret)
    assert answered.status_code == 200, answered.text  # the org's other key is not suspended with it
    assert await alerts_for(stack, sibling.key.key_id, "many_addresses") == []


@pytest.mark.timeout(480)  # the detector's restart (up to 180 s), then up to 180 s for the suspension
async def test_the_detector_comes_back_after_its_worker_crashes(base_url: str, make_caller,  # type: ignore[no-untyped-def]
                                                               processors: dict[str, ServiceProcess]) -> None:
    abuse = processors["abuse"]
    (worker,) = abuse.children()
    os.kill(worker, signal.SIGKILL)  # the Faust worker only: its supervisor must start a new one
    assert await wait_for(lambda: abuse.children() not in ([], [worker]), timeout_s=30)
    await asyncio.to_thread(abuse.wait_healthy, 180)
    burster = make_caller(org=f"org-burst2-{SESSION}", tier="free")
    await asyncio.gather(*(status_of(base_url, burster.secret) for _ in range(60)))
    # Generous on purpose: when the killed member's session ends, the group rebalances onto the new worker, and
    # Faust may then fence its own per-partition producers, crash and be started again (seen once in six
    # fresh-clone runs: a second crash 35 s after the burst, past the old 60 s budget). What is asserted is that
    # it comes back and counts, not how fast.
    assert await wait_for(lambda: suspended(base_url, burster.secret), timeout_s=180)
    assert "starting it again" in abuse.log_text()
