"""Adversarial review of the gateway-acceptance change (93d4ac5..HEAD): key-suspension memory, inline prompt
rendering, the stream record script, the collector's lazily moved timer, the synthetic step clock.

Each test here shows a defect of that change; see the review report for the severity of each."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
import uvloop

from producers.gateway.prompt import PromptBuilder
from producers.relay.collector import StreamCollector
from runtime.settings import ModelSettings, RedisSettings
from runtime.suspensions import KeySuspensions
from schemas.events import ChatMessage

# --- the collector's timer ---------------------------------------------------------------------------------


def test_a_timeout_on_uvloop_does_not_spin_the_loop_re_arming_its_timer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The gateway runs on uvloop (uvicorn's loop="auto" with uvicorn[standard]). uvloop rounds a timer's delay to
    whole milliseconds and its clock is the loop's cached millisecond, so a timer for a deadline with a sub-ms
    fraction (the first-token patience always has one: received_at + deadline - perf_counter()) goes off up to
    0.5 ms early; ``_on_timer`` then re-arms for a delay that rounds to 0 ms and goes off again at every loop
    iteration until the cached millisecond ticks: hundreds of callbacks, the loop busy-spinning, per timeout."""
    calls = 0
    real = StreamCollector._on_timer

    def counted(self: StreamCollector) -> None:
        nonlocal calls
        calls += 1
        real(self)

    monkeypatch.setattr(StreamCollector, "_on_timer", counted)

    async def main() -> None:
        for timeout_s in (0.0301, 0.0302, 0.0304):
            with pytest.raises(TimeoutError):
                await StreamCollector("r").get(timeout_s)

    uvloop.run(main())
    assert calls <= 6, f"{calls} timer callbacks for 3 timeouts (the loop spun re-arming the timer)"


async def test_a_wait_cancelled_as_its_timer_goes_off_leaves_no_phantom_news() -> None:
    """The timer sets ``_ready`` for the waiter; a waiter cancelled in that same loop iteration (before it resumes)
    never clears it, so the collector reports news it does not have and the next ``get`` returns at once with an
    empty, unfinished delta instead of waiting (a contract break of ``get``; today's only caller, ChatService._next,
    does not call ``get`` again after a cancellation, so this is latent)."""
    c = StreamCollector("r")
    loop = asyncio.get_running_loop()
    waiting = asyncio.ensure_future(c.get(0.05))
    await asyncio.sleep(0)
    assert c._timer is not None
    loop.call_at(c._timer.when(), waiting.cancel)  # e.g. the client goes away in the deadline's iteration
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert not c.has_news(), "no event was put, yet the collector says it has news"
    with pytest.raises(TimeoutError):
        await c.get(0.05)  # returns Delta(text='', token_count=0, finish_reason=None) at once


# --- inline prompt rendering --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
async def prompts() -> PromptBuilder:
    return await PromptBuilder.load(ModelSettings())


async def test_a_prompt_of_many_empty_messages_is_not_rendered_on_the_event_loop(
        prompts: PromptBuilder, monkeypatch: pytest.MonkeyPatch) -> None:
    """``tokens`` decides by content characters only: 5000 empty messages (a 150 KB body, well under the 1 MiB
    body limit; the context check that refuses it runs after rendering) count 0 characters and are rendered on the
    event loop, stalling every stream of the gateway for tens to hundreds of milliseconds (in a thread, as before
    the change, the loop kept running with ~5-10 ms gaps)."""
    rendered_on: list[int] = []
    real = prompts.render

    def spy(messages: list[ChatMessage]) -> list[int]:
        rendered_on.append(threading.get_ident())
        return real(messages)

    monkeypatch.setattr(prompts, "render", spy)
    messages = [ChatMessage(role="user", content="") for _ in range(5000)]
    started = time.perf_counter()
    ids = await prompts.tokens(messages)
    took = time.perf_counter() - started
    assert len(ids) > 20_000
    on_loop = rendered_on == [threading.get_ident()]
    assert not (on_loop and took > 0.005), f"rendered on the event loop, blocking it {took * 1000:.0f} ms"


# --- key suspensions ----------------------------------------------------------------------------------------


class _Session:
    def prepare(self, query: str) -> str:
        return query


class _SlowReplyRedis:
    """GET reads the value when Redis runs it; its reply reaches the caller only when ``reply`` is set (another
    pooled connection's reply, e.g. the SET's, can come first)."""

    def __init__(self) -> None:
        self.values: dict[str, str] = {}
        self.reply = asyncio.Event()

    async def get(self, key: str) -> str | None:
        value = self.values.get(key)
        await self.reply.wait()
        return value

    async def set(self, key: str, value: str) -> None:
        self.values[key] = value

    async def delete(self, key: str) -> int:
        return 1 if self.values.pop(key, None) is not None else 0


async def test_a_read_under_way_during_a_local_suspend_does_not_undo_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """``suspend`` records the reason in the memory at once, but a GET that Redis ran before the SET and whose reply
    is processed after ``suspend`` returned overwrites it with 'not suspended' for ``remember_s``: a suspension made
    on this process is not 'seen here at once' (latent: no gateway code calls suspend/lift today; the abuse
    processor and the CLI, which do, never call ``reason``)."""

    async def recorded(*_: object) -> list[dict[str, object]]:
        return []

    monkeypatch.setattr("runtime.suspensions.execute", recorded)
    redis = _SlowReplyRedis()
    fake: Any = redis
    session: Any = _Session()
    s = KeySuspensions(session, "ks", fake, RedisSettings(), remember_s=60)
    reading = asyncio.ensure_future(s.reason("k1"))
    for _ in range(3):
        await asyncio.sleep(0)  # the GET ran in Redis: not suspended
    await s.suspend("k1", "org", "abuse", "alert-1")
    redis.reply.set()
    assert await reading in (None, "abuse")  # the read under way may report either moment
    assert await s.reason("k1") == "abuse"
