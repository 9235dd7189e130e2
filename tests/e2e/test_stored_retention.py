"""Stored completions are kept 30 days (OpenAI's retention; Cassandra expires the rows, the listing's too), and a
request the safety pre-filter refused is not stored, whatever its ``store`` said."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC

import openai
import pytest

from runtime.cassandra_client import connect_async, execute
from runtime.settings import Settings
from schemas.events import SafetyStage, SafetyVerdict, StoredCompletion
from schemas.topics import TOPICS
from stream_processors.store.completions import month_of
from tests.conftest import Caller
from tests.e2e.conftest import MODEL, QUESTION, records_of
from tests.e2e.test_safety import HARMFUL
from tests.e2e.test_stored_completions import stored
from tests.helpers import wait_for

pytestmark = pytest.mark.e2e

THIRTY_DAYS_S = 30 * 24 * 3600


async def ttls(stack: Settings, completion_id: str, org_id: str) -> tuple[int, int]:
    """The seconds Cassandra keeps the completion's row, and its row in the org's listing."""
    ks = stack.cassandra.keyspace
    cluster, session = await connect_async(stack.cassandra)
    try:
        (row,) = await execute(session, f"SELECT TTL(content) AS ttl, created_at FROM {ks}.stored_completions "
                                        "WHERE completion_id = %s", [completion_id])
        listing = await execute(session, f"SELECT completion_id, TTL(model) AS ttl FROM "
                                          f"{ks}.stored_completions_by_org WHERE org_id = %s AND month = %s",
                                [org_id, month_of(row["created_at"].replace(tzinfo=UTC))])
    finally:
        await asyncio.to_thread(cluster.shutdown)
    (indexed,) = [r["ttl"] for r in listing if r["completion_id"] == completion_id]
    return row["ttl"], indexed


async def test_a_stored_completion_is_kept_thirty_days(base_url: str, caller: Caller, stack: Settings) -> None:
    async with openai.AsyncOpenAI(base_url=base_url, api_key=caller.secret, max_retries=0) as client:
        answer = await client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4, store=True)
        assert await stored(client, answer.id)
    kept_s, listed_s = await ttls(stack, answer.id, caller.key.org_id)
    # Written a moment ago: within minutes of the whole retention, and not kept forever (TTL null)
    for ttl in (kept_s, listed_s):
        assert ttl is not None and THIRTY_DAYS_S - 600 < ttl <= THIRTY_DAYS_S, (kept_s, listed_s)


async def test_a_request_refused_by_the_pre_filter_is_not_stored(base_url: str, make_caller,  # type: ignore[no-untyped-def]
                                                                 stack: Settings) -> None:
    tag = uuid.uuid4().hex[:8]
    caller = make_caller(org=f"org-refused-store-{tag}")  # a key of its own: refusals count towards suspension
    async with openai.AsyncOpenAI(base_url=base_url, api_key=caller.secret, max_retries=0) as client:
        chunks = [c async for c in await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": HARMFUL}], max_tokens=4, stream=True, store=True,
            metadata={"tag": tag})]
        assert chunks[-1].choices[0].finish_reason == "content_filter"
        refused_id = chunks[0].id
        await wait_for(lambda: records_of(stack, TOPICS.verdicts, SafetyVerdict, lambda v: (
            v.request_id == refused_id and v.stage is SafetyStage.PRE)), what="the pre-filter's verdict")
        # One asked for after the refusal was decided: once it is stored, the store has read past the refusal.
        later = await client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4, store=True,
                                                     metadata={"tag": tag})
        assert await stored(client, later.id)
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.retrieve(refused_id)
        listed = await client.chat.completions.list(metadata={"tag": tag})
    assert [c.id for c in listed.data] == [later.id]
    records = await records_of(stack, TOPICS.stored_completions, StoredCompletion,
                               lambda r: r.completion_id == refused_id and r.listed)
    assert records == [], "the refusal was put on the stored-completions topic to be stored"
