"""``kns bench relay --source tokens``: the lean token source stands in for a worker through a real gateway, and
every stream gets exactly its tokens (a bench whose load side lost or mangled streams would measure nothing)."""

from __future__ import annotations

import pytest

from bench.relay import Placement, stream_capacity
from bench.token_source import TEXT
from runtime.settings import Settings


@pytest.mark.timeout(240)  # a gateway and a token source start
async def test_streams_relayed_from_the_token_source_complete_with_every_token(stack: Settings) -> None:
    out = await stream_capacity(stack, [4], 25, 50.0, ttft_limit_s=30.0, itl_limit_s=30.0, report=lambda _: None,
                                placement=Placement(), source="tokens")
    (level,) = out["levels"]
    assert level["completed"] == 4 and level["errors"] == {}, level
    assert level["tokens_per_worker"] == [100]  # the source's own count of what it produced
    # and each stream's client received its 25 tokens' text, counted on the client's side
    assert level["content_bytes_per_stream"] == [25 * len(TEXT)] * 4, level["content_bytes_per_stream"]
    assert level["relayed_events_per_s"] and level["relayed_events_per_s"] > 0
    assert out["source"].startswith("bench.token_source")
