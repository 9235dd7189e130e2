"""Abuse: a key whose answers add up to far more tokens than its tier allows in a minute is flagged, then suspended
(the token-velocity rule), and ``kns keys suspended`` says so."""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest

from runtime.kafka_clients import make_producer
from runtime.settings import Settings
from schemas.codec import codec_for
from schemas.events import AbuseAction, UsageEvent, utcnow
from schemas.topics import TOPICS
from tests.conftest import SESSION
from tests.e2e.conftest import MODEL, kns
from tests.e2e.test_abuse import alerts_for, status_of, suspended
from tests.helpers import wait_for

pytestmark = pytest.mark.e2e

#: usage events of one key within a minute, each this many completion tokens: 300,000 in all, far beyond the free
#: tier's 20,000 a minute (the rule flags a key at a multiple of what its limits admit in the window and suspends at
#: twice that); one at a time, so that the count crosses the flag threshold before the suspend threshold
ANSWERS, TOKENS_EACH = 10, 30_000


def usage(key_id: str, org_id: str) -> UsageEvent:
    now = utcnow()
    return UsageEvent(request_id=f"chatcmpl-velocity-{uuid.uuid4().hex}", org_id=org_id, key_id=key_id, tier="free",
                      model=MODEL, prompt_tokens=10, completion_tokens=TOKENS_EACH, cached_tokens=0,
                      finish_reason="length", attempt=1, worker_id="test-velocity", requested_at=now, started_at=now,
                      finished_at=now)


@pytest.mark.timeout(180)
async def test_a_key_generating_tokens_far_beyond_its_tier_is_flagged_then_suspended(  # type: ignore[no-untyped-def]
        base_url: str, make_caller, stack: Settings, service_env: dict[str, str]) -> None:
    fast = make_caller(org=f"org-velocity-{SESSION}", tier="free", limits=None)  # the free tier's own limits
    assert (await status_of(base_url, fast.secret)).status_code == 200
    # The usage log is what the rule counts: its records as workers write them, without generating 300,000 tokens
    # on two cores.
    producer = make_producer(stack.kafka, role="test-velocity")
    await producer.start()
    try:
        for _ in range(ANSWERS):
            event = usage(fast.key.key_id, fast.key.org_id)
            await producer.send_and_wait(stack.kafka.topic(TOPICS.usage.name), codec_for(UsageEvent).encode(event),
                                         key=event.request_id.encode())
    finally:
        await producer.stop()

    assert await wait_for(lambda: suspended(base_url, fast.secret), timeout_s=90, what="the key suspended")
    error = (await status_of(base_url, fast.secret)).json()["error"]
    assert error["code"] == "key_suspended" and "token_velocity" in error["message"], error

    async def flagged_and_suspended() -> set[AbuseAction]:
        # The alert is sent just before the key is suspended; it may be read a moment after the suspension.
        actions = {a.action for a in await alerts_for(stack, fast.key.key_id, "token_velocity")}
        return actions if actions >= {AbuseAction.FLAG, AbuseAction.SUSPEND} else set()

    assert await wait_for(flagged_and_suspended, timeout_s=30, what="the token_velocity alerts committed") == {
        AbuseAction.FLAG, AbuseAction.SUSPEND}
    (alert,) = [a for a in await alerts_for(stack, fast.key.key_id, "token_velocity")
                if a.action is AbuseAction.SUSPEND]
    assert alert.threshold <= alert.observed <= ANSWERS * TOKENS_EACH and alert.window_s == 60

    listed = await asyncio.to_thread(kns, service_env, "keys", "suspended", "--json")
    assert listed.returncode == 0, listed.stderr
    (row,) = [r for r in json.loads(listed.stdout) if r["key_id"] == fast.key.key_id]
    assert row["org_id"] == fast.key.org_id and row["reason"].startswith("token_velocity")
    assert row["alert_id"] == alert.alert_id
