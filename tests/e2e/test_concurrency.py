"""Eight concurrent streams with different lengths: continuous batching, no cross-talk, no reordering."""

from __future__ import annotations

import asyncio

import openai
import pytest

from runtime.settings import Settings
from tests.e2e.conftest import MODEL, token_records

pytestmark = pytest.mark.e2e
LENGTHS = [4, 8, 12, 16, 24, 32, 40, 48]


async def test_eight_streams_each_get_their_own_tokens_in_order(aclient: openai.AsyncOpenAI, stack: Settings) -> None:
    async def one(n: int) -> tuple[int, str, str, int]:
        stream = await aclient.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Write {n} words about the number {n}."}],
            temperature=0, max_tokens=n, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        text, request_id, completion_tokens = "", "", -1
        async for chunk in stream:
            request_id = chunk.id
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
            if chunk.usage:
                completion_tokens = chunk.usage.completion_tokens
        return n, request_id, text, completion_tokens

    results = await asyncio.gather(*(one(n) for n in LENGTHS))
    final_offset, first_offset = {}, {}
    for n, request_id, text, completion_tokens in results:
        records = await token_records(stack, request_id)
        events = [e for _, e in records]
        # Each client got exactly its own events, in the order they were produced.
        assert [e.seq for e in events] == list(range(len(events))), "token events out of order"
        assert "".join(e.text for e in events) == text, "the stream is not exactly its own token events"
        assert sum(len(e.token_ids) for e in events) == n == completion_tokens
        first_offset[n], final_offset[n] = records[0][0], records[-1][0]
    # The reply partition records when the platform finished each request: the short ones first ...
    assert sorted(LENGTHS, key=lambda n: final_offset[n]) == LENGTHS
    # ... and batched, not queued: the longest was already streaming before the shortest had finished.
    assert first_offset[max(LENGTHS)] < final_offset[min(LENGTHS)]
