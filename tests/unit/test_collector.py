"""The relay's per-request merging slot: never blocks, never drops, restores order, drops duplicates."""

from __future__ import annotations

import asyncio

import pytest

from producers.relay.collector import StreamCollector
from schemas.events import TokenEvent, TokenUsage
from tests.helpers import run_in_virtual_time


def ev(seq: int, text: str, *, attempt: int = 1, offset: int | None = None, n: int = 1,
       final: str | None = None) -> TokenEvent:
    return TokenEvent(
        request_id="r", attempt=attempt, seq=seq, token_offset=seq if offset is None else offset,
        token_ids=list(range(n)), text=text, finish_reason=final,
        usage=TokenUsage(prompt_tokens=3, completion_tokens=seq + n) if final else None,
        worker_id="w", emitted_at_us=seq,
    )


async def test_deltas_put_while_nobody_reads_are_merged_in_order() -> None:
    c = StreamCollector("r")
    for i, word in enumerate(["The", " capital", " is"]):
        assert c.put(ev(i, word))
    delta = await c.get()
    assert (delta.text, delta.token_count, delta.finished) == ("The capital is", 3, False)
    c.put(ev(3, " Paris", final="stop"))
    last = await c.get()
    assert (last.text, last.finish_reason, last.usage.completion_tokens) == (" Paris", "stop", 4)


async def test_duplicate_and_stale_events_are_dropped() -> None:
    c = StreamCollector("r")
    c.put(ev(0, "a"))
    c.put(ev(1, "b"))
    assert not c.put(ev(1, "b"))  # redelivered
    assert not c.put(ev(0, "a"))
    assert (await c.get()).text == "ab"
    assert c.duplicates == 2


async def test_a_new_attempt_only_adds_tokens_the_client_has_not_seen() -> None:
    c = StreamCollector("r")
    c.put(ev(0, "one", offset=0))
    c.put(ev(1, " two", offset=1))
    assert (await c.get()).text == "one two"
    # failover: attempt 2 starts over at seq 0 / token 0
    c.put(ev(0, "one", attempt=2, offset=0))
    c.put(ev(1, " two", attempt=2, offset=1))
    c.put(ev(2, " three", attempt=2, offset=2, final="stop"))
    assert not c.put(ev(5, "late", attempt=1, offset=5))  # the old attempt is stale now
    delta = await c.get()
    assert (delta.text, delta.token_count, delta.finish_reason) == (" three", 1, "stop")


async def test_get_waits_for_news() -> None:
    c = StreamCollector("r")
    waiter = asyncio.create_task(c.get())
    await asyncio.sleep(0)  # the waiter runs up to its wait
    assert not waiter.done()
    c.put(ev(0, "x"))
    assert (await asyncio.wait_for(waiter, 1)).text == "x"


async def test_fail_ends_the_stream_with_an_error_once() -> None:
    c = StreamCollector("r")
    c.put(ev(0, "partial"))
    c.fail("relay stopped", "gateway_stopping")
    delta = await c.get()
    assert (delta.text, delta.finish_reason, delta.error) == ("partial", "error", "relay stopped")
    assert (delta.error_code, delta.from_worker) == ("gateway_stopping", False)
    assert not c.put(ev(1, "more"))


async def test_an_inconsistent_event_ends_the_stream_at_once_with_an_error() -> None:
    c = StreamCollector("r")
    c.put(ev(0, "a"))
    assert not c.put(ev(2, "c"))  # seq 1 was lost
    delta = await c.get()
    assert (delta.text, delta.finish_reason, delta.from_worker) == ("a", "error", False)
    assert "missing" in (delta.error or "")


async def test_a_wait_without_news_times_out_and_news_after_it_is_still_delivered() -> None:
    c = StreamCollector("r")
    loop = asyncio.get_running_loop()
    started = loop.time()
    try:
        await c.get(0.05)
    except TimeoutError:
        pass
    else:
        raise AssertionError("no TimeoutError")
    assert loop.time() - started >= 0.05
    c.put(ev(0, "a"))
    assert (await c.get(0.05)).text == "a"


def test_each_wait_has_its_own_deadline_with_one_timer_moved_lazily() -> None:
    """On a virtual clock: the timer armed for an earlier wait has gone off (every timer due fires before the
    clock moves on) when the later wait is checked, whatever the machine's load."""
    async def scenario() -> None:
        c, loop = StreamCollector("r"), asyncio.get_running_loop()
        first = asyncio.ensure_future(c.get(0.05))
        await asyncio.sleep(0.01)
        c.put(ev(0, "a"))
        assert (await first).text == "a"
        # the timer armed for the first wait goes off at 0.05 s: this wait is not over then
        second = asyncio.ensure_future(c.get(0.3))
        await asyncio.sleep(0.15)
        assert not second.done()
        c.put(ev(1, "b"))
        assert (await second).text == "b"
        # a shorter wait after a longer one still ends at its own deadline
        long_wait = asyncio.ensure_future(c.get(5))
        await asyncio.sleep(0)
        long_wait.cancel()
        await asyncio.wait([long_wait])  # ended: its clean-up would clear the deadline of a wait begun before it
        started = loop.time()
        with pytest.raises(TimeoutError):
            await c.get(0.05)
        assert loop.time() - started == pytest.approx(0.05, abs=0.002)

    run_in_virtual_time(scenario)


async def test_news_that_comes_as_the_timer_goes_off_is_delivered_not_lost() -> None:
    c = StreamCollector("r")
    waiting = asyncio.ensure_future(c.get(0.02))
    await asyncio.sleep(0.02)
    c.put(ev(0, "a"))  # same moment as the deadline: either outcome must keep the token
    try:
        text = (await waiting).text
    except TimeoutError:
        text = (await c.get(0.05)).text
    assert text == "a"


def test_a_wait_begun_before_a_cancelled_waits_clean_up_still_ends_at_its_deadline() -> None:
    """A wait cancelled (its client left) cleans up only when its task next runs; a wait another task began before
    then must keep its own deadline (it lost it: its ``get`` never timed out, a stream with no news hung for good)."""
    async def scenario() -> None:
        c, loop = StreamCollector("r"), asyncio.get_running_loop()
        long_wait = asyncio.ensure_future(c.get(5))
        await asyncio.sleep(0)
        long_wait.cancel()  # its clean-up runs on its next step, after the wait below has begun
        started = loop.time()
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(10):  # only stops a hang (in this task: the wait begins before the clean-up)
                await c.get(0.05)
        assert loop.time() - started == pytest.approx(0.05, abs=0.002)
        await asyncio.wait([long_wait])

    run_in_virtual_time(scenario)
