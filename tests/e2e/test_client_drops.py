"""Issues 36 and 37 on the real stack: a stream survives its client's own dropped connection, an explicit cancel
works from any gateway, and no cancel from any gateway lowers the bill below what a client of the stream received.

A streamed client whose connection drops is detached, not cancelled: the worker suspends the generation for the
resume window; a client back within the window (Last-Event-ID, on any gateway) gets every token once, in order (the
generation goes on from what it emitted); one that never comes back is cancelled when the window ends, billed what
the log holds (what it read, and what was in flight when it dropped)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from runtime.settings import Settings
from schemas.events import UsageEvent
from schemas.token_stream import TokenStream
from schemas.topics import TOPICS
from tests.conftest import GATEWAY_PORT, WORKER_ADMIN_PORT, Caller
from tests.e2e.conftest import gateway_process, records_of, token_records
from tests.e2e.test_resume import BODY, Received, events, read
from tests.helpers import ServiceProcess, wait_for

pytestmark = pytest.mark.e2e

#: a gateway whose dropped streams wait 2 s for their client, and one where a drop cancels at once
SHORT_WINDOW_PORT, NO_WINDOW_PORT = GATEWAY_PORT + 12, GATEWAY_PORT + 13
SHORT_WINDOW_S = 2.0


@pytest.fixture(scope="module")
def gateways(gateway: ServiceProcess, service_env: dict[str, str]) -> Iterator[None]:
    procs = [gateway_process(SHORT_WINDOW_PORT, service_env, KNS_GATEWAY__RESUME_WINDOW_S=str(SHORT_WINDOW_S)),
             gateway_process(NO_WINDOW_PORT, service_env, KNS_GATEWAY__RESUME_WINDOW_S="0")]
    for proc in procs:
        proc.start()
    try:
        for proc in procs:
            proc.wait_healthy(120)
        yield
    finally:
        for proc in procs:
            proc.stop()


def url(port: int) -> str:
    return f"http://127.0.0.1:{port}/v1"


async def in_flight(request_id: str) -> dict[str, object] | None:
    """The worker's view of a request it generates (``/state``), None once it is not generating it."""
    async with httpx.AsyncClient(timeout=5) as http:
        jobs = (await http.get(f"http://127.0.0.1:{WORKER_ADMIN_PORT}/state")).json().get("in_flight", [])
    return next((j for j in jobs if j["request_id"] == request_id), None)


async def usage_of(stack: Settings, request_id: str) -> list[UsageEvent]:
    return await records_of(stack, TOPICS.usage, UsageEvent, lambda e: e.request_id == request_id)


async def tokens_through(stack: Settings, request_id: str, position: int) -> int:
    """Completion tokens of the first ``position`` deltas of the stream as every reader merges it: what a client
    whose last event is at ``position`` has received."""
    stream, deltas, tokens = TokenStream(request_id), 0, 0
    for _, event in await token_records(stack, request_id):
        accepted = stream.put(event)
        if accepted is not None and deltas < position:  # positions count every delta the merge accepts
            deltas += 1
            tokens += accepted.tokens
    return tokens


async def drop_after(http: httpx.AsyncClient, caller: Caller, port: int, content_events: int) -> Received:
    """A streamed request whose client drops its connection after ``content_events`` events with text."""
    before = Received()
    async with http.stream("POST", f"{url(port)}/chat/completions", json=BODY,
                           headers={"Authorization": f"Bearer {caller.secret}"}) as response:
        assert response.status_code == 200
        await read(events(response), before, stop_after=content_events)
    return before  # leaving the block closed the connection mid-stream


def request_id_of(received: Received) -> str:
    return received.last_id.rpartition(":")[0]


async def test_a_dropped_client_back_within_the_window_on_another_gateway_gets_every_token_once(
        gateways: None, caller: Caller, stack: Settings) -> None:
    client = openai.AsyncOpenAI(base_url=url(GATEWAY_PORT), api_key=caller.secret)
    sdk_body = {k: v for k, v in BODY.items() if k != "ignore_eos"} | {"extra_body": {"ignore_eos": True}}
    reference = "".join([c.choices[0].delta.content or "" async for c in await client.chat.completions.create(
        **sdk_body) if c.choices])  # type: ignore[arg-type]
    async with httpx.AsyncClient(timeout=120) as http:
        before = await drop_after(http, caller, SHORT_WINDOW_PORT, 5)
    request_id = request_id_of(before)
    # Nobody listens: the worker suspends the generation, for the client to come back
    await wait_for(lambda: _suspended(request_id), timeout_s=10, what="the worker suspending the generation")
    stream = await client.chat.completions.create(**sdk_body, extra_headers={"Last-Event-ID": before.last_id})  # type: ignore[arg-type]
    after = [c async for c in stream]
    text = "".join(c.choices[0].delta.content or "" for c in after if c.choices)
    assert before.text + text == reference  # each token once, in order, what was held included
    assert after[-1].choices[0].finish_reason == "length"
    (usage,) = await wait_for(lambda: usage_of(stack, request_id), timeout_s=30, what="its usage")
    assert (usage.finish_reason, usage.completion_tokens) == ("length", BODY["max_tokens"])


async def _suspended(request_id: str) -> bool:
    job = await in_flight(request_id)
    return job is not None and bool(job["suspended"]) and not job["attended"]


async def test_a_dropped_client_that_never_returns_is_cancelled_when_its_window_ends_billed_what_it_received(
        gateways: None, caller: Caller, stack: Settings) -> None:
    async with httpx.AsyncClient(timeout=120) as http:
        before = await drop_after(http, caller, SHORT_WINDOW_PORT, 5)
    dropped_at = time.time()
    request_id = request_id_of(before)
    (usage,) = await wait_for(lambda: usage_of(stack, request_id), timeout_s=30, what="its usage")
    received = await tokens_through(stack, request_id, before.positions()[-1])
    in_log = await tokens_through(stack, request_id, 10**6)
    assert (usage.finish_reason, usage.completion_tokens) == ("cancelled", in_log)
    waited_s = usage.finished_at.timestamp() - dropped_at
    assert SHORT_WINDOW_S - 0.5 <= waited_s <= SHORT_WINDOW_S + 5, f"cancelled {waited_s:.1f} s after the drop"
    # Suspended for the window: the log has no more than the client read and what was in flight when it dropped
    assert in_log - received <= 2, f"{in_log - received} tokens in the log beyond what the client received"


async def test_an_explicit_cancel_from_another_gateway_stops_the_stream_billed_for_what_its_reader_got(
        gateways: None, caller: Caller, stack: Settings) -> None:
    async with httpx.AsyncClient(timeout=120) as http:
        reader = Received()
        async with http.stream("POST", f"{url(GATEWAY_PORT)}/chat/completions", json=BODY,
                               headers={"Authorization": f"Bearer {caller.secret}"}) as response:
            stream = events(response)
            await read(stream, reader, stop_after=3)
            request_id = request_id_of(reader)
            cancelled = await http.post(f"{url(SHORT_WINDOW_PORT)}/chat/completions/{request_id}/cancel",
                                        headers={"Authorization": f"Bearer {caller.secret}"})
            assert cancelled.status_code == 200, cancelled.text
            await read(stream, reader)  # the rest, to the stream's end
        assert reader.done and [e["code"] for e in reader.errors] == ["cancelled"]
        (usage,) = await wait_for(lambda: usage_of(stack, request_id), timeout_s=30, what="its usage")
        received = await tokens_through(stack, request_id, reader.positions()[-1])
        assert usage.finish_reason == "cancelled" and 0 < usage.completion_tokens == received < BODY["max_tokens"]
        again = await http.post(f"{url(GATEWAY_PORT)}/chat/completions/{request_id}/cancel",
                                headers={"Authorization": f"Bearer {caller.secret}"})
        unknown = await http.post(f"{url(GATEWAY_PORT)}/chat/completions/chatcmpl-nope/cancel",
                                  headers={"Authorization": f"Bearer {caller.secret}"})
    assert (again.status_code, again.json()["error"]["code"]) == (409, "completion_finished")
    assert unknown.status_code == 404


async def test_a_resume_dropped_at_once_on_another_gateway_bills_what_the_first_gateway_delivered(
        gateways: None, caller: Caller, stack: Settings) -> None:
    """Issue 37 C1: a stream read on gateway A; the same stream resumed on gateway B (where a drop cancels at once)
    and dropped at once. B's connection received nothing; A's client received every token up to the cancel: the
    bill covers them (it was 0 before: no ledger row, TPM refunded)."""
    async with httpx.AsyncClient(timeout=120) as http:
        reader = Received()
        async with http.stream("POST", f"{url(GATEWAY_PORT)}/chat/completions", json=BODY,
                               headers={"Authorization": f"Bearer {caller.secret}"}) as response:
            stream = events(response)
            await read(stream, reader, stop_after=20)
            request_id = request_id_of(reader)
            async with http.stream("GET", f"{url(NO_WINDOW_PORT)}/chat/completions/{request_id}?stream=true",
                                   headers={"Authorization": f"Bearer {caller.secret}",
                                            "Last-Event-ID": reader.last_id}) as resumed:
                assert resumed.status_code == 200
            await read(stream, reader)
    (usage,) = await wait_for(lambda: usage_of(stack, request_id), timeout_s=30, what="its usage")
    received = await tokens_through(stack, request_id, reader.positions()[-1])
    assert usage.completion_tokens == received >= 20 and usage.prompt_tokens > 0
