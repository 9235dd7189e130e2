"""A request id that reaches the worker twice is generated once and billed once."""

from __future__ import annotations

import uuid

import pytest

from runtime.kafka_clients import make_producer
from runtime.settings import Settings
from schemas.codec import codec_for
from schemas.events import ChatMessage, ChatRequest, ReplyTo, SamplingSpec, utcnow
from schemas.topics import TOPICS
from tests.conftest import WORKER_ADMIN_PORT
from tests.e2e.conftest import MODEL, metric, scrape, token_events, usage_events
from tests.helpers import ServiceProcess, wait_for

pytestmark = pytest.mark.e2e
NOBODYS_PARTITION = 12  # no gateway tails it: only the topic tells what the worker did


async def test_a_duplicated_request_record_is_generated_once(worker: ServiceProcess, stack: Settings) -> None:
    kafka = stack.kafka
    skipped_before = metric(scrape(f"http://127.0.0.1:{WORKER_ADMIN_PORT}/metrics"),
                            "kns_worker_requests_skipped_total", reason="duplicate")
    request = ChatRequest(
        request_id=f"chatcmpl-dup-{uuid.uuid4().hex}", created_at=utcnow(), org_id="org-dup", key_id="k", tier="pro",
        model=MODEL, messages=[ChatMessage(role="user", content="Say hi.")], prompt_token_ids=[1, 4093, 198, 17, 2, 198,
        1, 520, 9531, 198], sampling=SamplingSpec(max_tokens=6, temperature=0.0, ignore_eos=True), stream=True,
        reply=ReplyTo(partition=NOBODYS_PARTITION, gateway_id="test"),
    )
    producer = make_producer(kafka, role="test-dup")
    await producer.start()
    try:
        for _ in range(2):  # the same request twice, as an upstream retry would produce it
            await producer.send_and_wait(kafka.topic(TOPICS.requests_admitted.name),
                                         codec_for(ChatRequest).encode(request), key=request.request_id.encode())
    finally:
        await producer.stop()

    # Both copies handled: the second skipped as a duplicate, the first committed with its usage. Nothing of this
    # request can come after both.
    await wait_for(lambda: metric(scrape(f"http://127.0.0.1:{WORKER_ADMIN_PORT}/metrics"),
                                  "kns_worker_requests_skipped_total", reason="duplicate") == skipped_before + 1,
                   what="the second copy skipped as a duplicate")
    usage = await wait_for(lambda: usage_events(stack, request.request_id), timeout_s=30,
                           what="the first copy's usage committed")
    assert len(usage) == 1 and usage[0].completion_tokens == 6
    events = await token_events(stack, request.request_id)
    assert {e.attempt for e in events} == {events[0].attempt}, "generated under two attempts"
    assert [e.seq for e in events] == list(range(len(events))), "a token event twice, or one missing"
    assert sum(len(e.token_ids) for e in events) == 6, "more tokens in the log than one generation's"
    finals = [e for e in events if e.finish_reason]
    assert len(finals) == 1 and finals[0].usage.completion_tokens == 6
