"""Eight concurrent streams with different lengths: continuous batching, no cross-talk, no reordering."""

from __future__ import annotations

import asyncio
import itertools

import openai
import pytest

from runtime.settings import Settings
from tests.e2e.conftest import MODEL, token_records

pytestmark = pytest.mark.e2e
LENGTHS = [4, 8, 12, 16, 24, 32, 40, 48]


async def test_eight_streams_each_get_their_own_tokens_in_order(aclient: openai.AsyncOpenAI, stack: Settings) -> None:
    async def one(n: int, generating: asyncio.Event | None = None) -> tuple[int, str, str, int]:
        stream = await aclient.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Write {n} words about the number {n}."}],
            temperature=0, max_tokens=n, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        text, request_id, completion_tokens = "", "", -1
        async for chunk in stream:
            request_id = chunk.id
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
                if generating is not None:
                    generating.set()
            if chunk.usage:
                completion_tokens = chunk.usage.completion_tokens
        return n, request_id, text, completion_tokens

    # The longest goes first and the others only once it is generating: whatever the gateway's pace on a busy
    # machine, the engine then has to share its steps with them (batching) or make them wait (queueing).
    longest, shortest = max(LENGTHS), min(LENGTHS)
    generating = asyncio.Event()
    first = asyncio.create_task(one(longest, generating))
    waiting = asyncio.create_task(generating.wait())
    await asyncio.wait([first, waiting], return_when=asyncio.FIRST_COMPLETED)
    waiting.cancel()
    assert generating.is_set(), f"the longest stream ended without a token: {first.result()}"
    results = [*await asyncio.gather(*(one(n) for n in LENGTHS if n != longest)), await first]
    final_offset, first_offset = {}, {}
    requests_by_record: dict[int, set[str]] = {}
    for n, request_id, text, completion_tokens in results:
        records = await token_records(stack, request_id)
        for offset, _ in records:
            requests_by_record.setdefault(offset, set()).add(request_id)
        events = [e for _, e in records]
        # Each client got exactly its own events, in the order they were produced.
        assert [e.seq for e in events] == list(range(len(events))), "token events out of order"
        assert "".join(e.text for e in events) == text, "the stream is not exactly its own token events"
        assert sum(len(e.token_ids) for e in events) == n == completion_tokens
        first_offset[n], final_offset[n] = records[0][0], records[-1][0]
    # Batched, not queued: every other request started generating before the longest had finished, and the
    # shortest, started after it, finished before it.
    assert all(first_offset[n] < final_offset[longest] for n in LENGTHS), (first_offset, final_offset)
    assert final_offset[shortest] < final_offset[longest], (first_offset, final_offset)
    # One record per engine step for the gateway's reply partition: the streams generated together share records.
    assert max(len(rids) for rids in requests_by_record.values()) >= 2, "every record carries a single request"
    # The reply partition records when the platform finished each request: one engine step per token, so of two
    # requests the shorter, if it started no later, finished first. (Which of the seven the gateway submitted first
    # is up to a busy machine: only the order the log shows counts.)
    for a, b in itertools.permutations(LENGTHS, 2):
        if a < b and first_offset[a] < first_offset[b]:
            assert final_offset[a] < final_offset[b], f"{a} tokens finished after {b}: {first_offset}, {final_offset}"
