"""Each tier's requests land on the work queue of its priority class, and ``KNS_TENANCY__TIERS__<TIER>__PRIORITY``
moves a tier to another class: a free request then lands on the high class's queue (and is answered)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from runtime.settings import Settings
from schemas.events import ChatRequest
from schemas.topics import TOPICS, TopicSpec
from tests.conftest import GATEWAY_PORT, SESSION
from tests.e2e.conftest import MODEL, gateway_process, records_of
from tests.helpers import ServiceProcess

pytestmark = pytest.mark.e2e

#: a gateway whose free tier is in the high class (the pre-filter off: the gateway routes to the work queues itself)
MOVED_PORT = GATEWAY_PORT + 21


@pytest.fixture(scope="module")
def moved(gateway: ServiceProcess, service_env: dict[str, str]) -> Iterator[int]:
    proc = gateway_process(MOVED_PORT, service_env, KNS_TENANCY__TIERS__FREE__PRIORITY="high",
                           KNS_SAFETY__PREFILTER="false")
    proc.start()
    try:
        proc.wait_healthy(120)
        yield MOVED_PORT
    finally:
        proc.stop()


async def answered_on(port: int, secret: str) -> str:
    async with httpx.AsyncClient(timeout=120) as http:
        answer = await http.post(f"http://127.0.0.1:{port}/v1/chat/completions",
                                 headers={"Authorization": f"Bearer {secret}"},
                                 json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                       "max_tokens": 1})
    assert answer.status_code == 200, answer.text
    return answer.json()["id"]  # type: ignore[no-any-return]


async def queues_holding(stack: Settings, request_id: str) -> list[TopicSpec]:
    held = []
    for spec in TOPICS.work_queues():
        if await records_of(stack, spec, ChatRequest, lambda r: r.request_id == request_id):
            held.append(spec)
    return held


async def test_each_tier_lands_on_its_classs_work_queue(gateway: ServiceProcess, make_caller,  # type: ignore[no-untyped-def]
                                                       stack: Settings) -> None:
    landed = {}
    for tier in ("free", "plus", "enterprise"):
        caller = make_caller(org=f"org-class-{tier}-{SESSION}", tier=tier)
        request_id = await answered_on(GATEWAY_PORT, caller.secret)  # through the safety pre-filter
        landed[tier] = await queues_holding(stack, request_id)  # answered: a worker has read it from there
    assert landed == {"free": [TOPICS.requests_admitted_low], "plus": [TOPICS.requests_admitted],
                      "enterprise": [TOPICS.requests_admitted_high]}


async def test_a_tier_moved_to_the_high_class_lands_on_its_queue(moved: int, make_caller, stack: Settings) -> None:  # type: ignore[no-untyped-def]
    caller = make_caller(org=f"org-class-moved-{SESSION}", tier="free")
    request_id = await answered_on(moved, caller.secret)
    assert await queues_holding(stack, request_id) == [TOPICS.requests_admitted_high]
