"""A client that hangs up mid-stream stops the generation in the worker (not just on the wire): a streaming client's
generation is suspended for its resume window and aborted by its cancel; a non-streaming client's is cancelled."""

from __future__ import annotations

import itertools

import httpx
import openai
import pytest

from runtime.settings import Settings
from tests.conftest import WORKER_ADMIN_PORT, Caller
from tests.e2e.conftest import MODEL, metric, scrape, usage_events
from tests.helpers import wait_for

pytestmark = pytest.mark.e2e
WORKER = f"http://127.0.0.1:{WORKER_ADMIN_PORT}"
# Long, and at temperature 0 the same text every run: a sampled "long story" was once halted by the safety
# post-filter (weapons) before the client hung up, which is a different ending than the one under test.
COUNTING = [{"role": "user", "content": "Count from 1 to 1000, one number per line."}]


def in_flight() -> list[str]:
    return [j["request_id"] for j in httpx.get(f"{WORKER}/state", timeout=5).json()["in_flight"]]


def job(request_id: str) -> dict[str, object] | None:
    return next((j for j in httpx.get(f"{WORKER}/state", timeout=5).json()["in_flight"]
                 if j["request_id"] == request_id), None)


async def test_closing_a_stream_suspends_the_generation_and_its_cancel_aborts_it(
        client: openai.OpenAI, stack: Settings) -> None:
    """A closed connection is a drop, not a cancel (the resume window, docs/API.md): the worker stops generating for
    nobody at once and keeps the generation for the client's return; the client's explicit cancel aborts it."""
    aborted_before = metric(scrape(f"{WORKER}/metrics"), "kns_worker_requests_aborted_total", cause="cancel")
    stream = client.chat.completions.create(
        model=MODEL, messages=COUNTING, temperature=0, max_tokens=1500, stream=True, extra_body={"ignore_eos": True})
    try:
        received = list(itertools.islice(stream, 5))
        assert len(received) == 5, f"the stream ended after {len(received)} chunks, long before its 1500 tokens"
        assert all(c.choices and c.choices[0].finish_reason is None for c in received), "the stream has finished"
        request_id = received[-1].id
        assert request_id in in_flight()
    finally:
        stream.close()  # also when an assertion failed: 1500 tokens would slow every later test

    suspended = await wait_for(lambda: (j := job(request_id)) is not None and j["suspended"] and j, timeout_s=30,
                               what="the generation suspended after its client hung up")
    assert 0 < suspended["tokens"] < 1500
    async with httpx.AsyncClient(timeout=10) as http:
        cancelled = await http.post(f"{client.base_url}chat/completions/{request_id}/cancel",
                                    headers={"Authorization": f"Bearer {client.api_key}"})
    assert cancelled.status_code == 200, cancelled.text
    await wait_for(lambda: request_id not in in_flight(), timeout_s=30, what="the cancelled generation gone")
    aborted = metric(scrape(f"{WORKER}/metrics"), "kns_worker_requests_aborted_total", cause="cancel")
    assert aborted == aborted_before + 1
    (usage,) = await wait_for(lambda: usage_events(stack, request_id), timeout_s=10)
    assert usage.finish_reason == "cancelled"
    # billed for what its client received before it hung up, not for max_tokens nor for time suspended
    assert 0 < usage.completion_tokens <= suspended["tokens"]


async def test_a_non_streaming_client_that_hangs_up_cancels_too(base_url: str, caller: Caller) -> None:
    aborted_before = metric(scrape(f"{WORKER}/metrics"), "kns_worker_requests_aborted_total", cause="cancel")
    body = {"model": MODEL, "messages": COUNTING, "temperature": 0, "max_tokens": 1500, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=3.0) as http:  # gives up long before 1500 tokens
        with pytest.raises(httpx.ReadTimeout):
            await http.post(f"{base_url}/chat/completions", json=body,
                            headers={"Authorization": f"Bearer {caller.secret}"})
    assert await wait_for(lambda: metric(scrape(f"{WORKER}/metrics"), "kns_worker_requests_aborted_total",
                                         cause="cancel") == aborted_before + 1, timeout_s=30)
    assert await wait_for(lambda: in_flight() == [], timeout_s=30)
