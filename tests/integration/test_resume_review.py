"""Resumable streams and stored completions under faults (real Kafka, Cassandra), from an adversarial review of
the resume / stored-completions change: each test fails on the reviewed code for the reason in its docstring."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import pytest
import pytest_asyncio
from aiokafka import ConsumerRecord

from producers.relay import demux
from producers.relay.demux import Relay
from runtime.cassandra_client import connect_async
from runtime.kafka_clients import make_producer
from runtime.settings import KafkaSettings, Settings
from schemas.codec import codec_for
from schemas.events import ChatMessage, StoredCompletion, TokenEvent, TokenUsage
from schemas.topics import TOPICS
from stream_processors.store import completions
from stream_processors.store.completions import CompletionStore
from tests.helpers import drain_stream as drain
from tests.helpers import token_event as token
from tests.helpers import wait_for

pytestmark = pytest.mark.integration
#: partitions of the token topic of their own (test_relay_resume.py uses 13 and 14)
RACE, IDLE_OWN, IDLE_OTHER, BACKLOG = 9, 10, 11, 12


# --- relay ------------------------------------------------------------------------------------------------------


async def test_a_resume_that_rewinds_a_busy_feed_gets_every_event_of_its_stream(kafka: KafkaSettings) -> None:
    """A resume behind the feed's position (another stream of this gateway's partition, or a second resume
    on a foreign feed already open) only *asks* for a rewind (``_Feed.add`` sets ``_rewind_to``); the seek
    happens at the top of the next loop turn. The feed is almost always awaiting ``getmany`` when ``add`` runs,
    so the batch that getmany then returns is routed first: when its first record is the resumed stream's next
    live event (offset >= position), ``_route`` hands it over and moves the sink's ``next_offset`` past it; after
    the seek, the stream's earlier events (its backlog) are all ``< next_offset`` and dropped. The client gets
    ``stream_inconsistent`` ("token events 0..1 are missing") instead of the rest of its stream.
    (demux.py _run: the rewind check runs after routing a record, not before.)"""
    topic = kafka.topic(TOPICS.tokens.name)
    codec = codec_for(TokenEvent)
    producer = make_producer(kafka, role="test")
    await producer.start()
    relay = Relay(kafka, topic, RACE)
    await relay.start()
    try:
        results = []
        for n in range(3):
            rid = f"resumed-{n}"
            # Its first events: generated while its client was away, already passed by the feed.
            early = (await producer.send_and_wait(topic, codec.encode(token(rid, 0)), key=rid.encode(),
                                                  partition=RACE)).offset
            await producer.send_and_wait(topic, codec.encode(token(rid, 1)), key=rid.encode(), partition=RACE)
            live = relay.register(f"live-{n}")
            await producer.send_and_wait(topic, codec.encode(token(f"live-{n}", 0)), key=f"live-{n}".encode(),
                                         partition=RACE)
            await asyncio.wait_for(live.get(), 10)  # the feed routed it, and is back in getmany
            resumed = await relay.resume(rid, RACE, early, skip_through=0)
            # The resumed stream's next event is generated now (the worker goes on generating it).
            await producer.send_and_wait(topic, codec.encode(token(rid, 2, final=True)), key=rid.encode(),
                                         partition=RACE)
            text, last = await drain(resumed)
            results.append((text, last.finish_reason, last.error))
            relay.unregister(rid)
            relay.unregister(f"live-{n}")
        assert results == [("<0><1><2>", "stop", None)] * 3
    finally:
        await relay.stop()
        await producer.stop()


async def test_a_feed_opened_for_a_resume_whose_client_left_is_closed_when_idle(
        kafka: KafkaSettings, monkeypatch: pytest.MonkeyPatch) -> None:
    """A resume of another gateway's partition opens a feed (a Kafka consumer and a task polling every 200 ms).
    If the resuming client leaves while the feed is opening (the resume task is cancelled at ``await
    asyncio.shield(opening)``), the shielded opening completes and puts the feed in ``_others`` with no sink and
    ``idle_since = None``; the janitor only closes feeds whose ``idle_since`` is set, so this one polls forever.
    (demux.py _Feed.__init__ idle_since None; Relay._close_idle_feeds.)"""
    monkeypatch.setattr(demux, "IDLE_FEED_S", 0.3)
    topic = kafka.topic(TOPICS.tokens.name)
    relay = Relay(kafka, topic, IDLE_OWN)
    await relay.start()
    try:
        resuming = asyncio.ensure_future(relay.resume("gone", IDLE_OTHER, 0, skip_through=0))
        await asyncio.sleep(0)  # the feed is opening
        resuming.cancel()
        await wait_for(lambda: IDLE_OTHER in relay._others, timeout_s=10, interval_s=0.05)
        assert IDLE_OTHER in relay._others  # the opening went on without its client
        await wait_for(lambda: IDLE_OTHER not in relay._others, timeout_s=10, interval_s=0.05,
                       what="a feed nobody uses closed after its idle period (0.3 s)")
    finally:
        await relay.stop()


async def test_a_resume_far_behind_does_not_stall_the_other_streams_of_the_feed(kafka: KafkaSettings,
                                                                               monkeypatch: pytest.MonkeyPatch
                                                                               ) -> None:
    """Resuming a stream of this gateway's own partition (or replaying a finished one: GET ?stream=true, not
    rate limited) rewound the gateway's *only* feed of that partition to the stream's first offset, up to the
    resume window (15 min) back. Every other open stream of the gateway sat behind the re-read of that whole
    backlog: their next token waited until the feed was back at the head (100k records, a busy gateway's partition
    in the window, took seconds on a loaded box; any org's client could do it to every other org's streams). Here
    the re-read is held half-way (as slow as a long one can be) and an unrelated live stream's next token must
    arrive meanwhile: no time bound, so a loaded machine cannot decide it. (demux.py: a resume gets a feed of its
    own, the live one never goes back.)"""
    topic = kafka.topic(TOPICS.tokens.name)
    codec = codec_for(TokenEvent)
    producer = make_producer(kafka, role="test")
    await producer.start()
    try:
        old = (await producer.send_and_wait(topic, codec.encode(token("old", 0, final=True)), key=b"old",
                                            partition=BACKLOG)).offset
        other = codec.encode(token("someone-else", 0))
        sends = [await producer.send(topic, other, key=b"someone-else", partition=BACKLOG) for _ in range(1000)]
        backlog_end = (await asyncio.gather(*sends))[-1].offset + 1
        held, released = asyncio.Event(), asyncio.Event()
        route = demux._Feed._route

        async def slow_reread(feed: demux._Feed, record: ConsumerRecord[bytes, bytes]) -> None:
            if old < record.offset < backlog_end:  # the backlog, read again for the replay: held
                held.set()
                await released.wait()
            await route(feed, record)

        monkeypatch.setattr(demux._Feed, "_route", slow_reread)
        relay = Relay(kafka, topic, BACKLOG)
        await relay.start()
        try:
            live = relay.register("live")
            await producer.send_and_wait(topic, codec.encode(token("live", 0)), key=b"live", partition=BACKLOG)
            await asyncio.wait_for(live.get(), 10)
            replay = await relay.resume("old", BACKLOG, old, skip_through=0)  # a replay of a finished stream
            await wait_for(held.is_set, timeout_s=20, interval_s=0.01, what="the replay re-reading the backlog")
            await producer.send_and_wait(topic, codec.encode(token("live", 1)), key=b"live", partition=BACKLOG)
            delta = await asyncio.wait_for(live.get(), 20)  # TimeoutError: it waits behind the re-read
            assert delta.text == "<1>"
            assert relay.position > backlog_end  # the live feed never went back
            released.set()
            text, last = await drain(replay, 60)
            assert (text, last.finish_reason) == ("<0>", "stop")
        finally:
            released.set()
            await relay.stop()
    finally:
        await producer.stop()


# --- stored completions -------------------------------------------------------------------------------------------


@pytest_asyncio.fixture(loop_scope="session")
async def store(stack: Settings) -> AsyncIterator[CompletionStore]:
    cluster, session = await connect_async(stack.cassandra)
    yield await CompletionStore.open(session, stack.cassandra.keyspace)
    await asyncio.to_thread(cluster.shutdown)


def stored(org: str, created_at: datetime, **metadata: str) -> StoredCompletion:
    return StoredCompletion(completion_id=f"chatcmpl-{uuid.uuid4().hex}", org_id=org, key_id="k", model="m",
                            created_at=created_at, messages=[ChatMessage(role="user", content="hi")],
                            metadata=metadata, text="hello", finish_reason="stop",
                            usage=TokenUsage(prompt_tokens=1, completion_tokens=1))


async def test_a_filtered_listing_that_hits_the_scan_limit_says_it_has_more(
        store: CompletionStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """``CompletionStore.page`` filters metadata/model after reading the index, and stops after ``SCAN_LIMIT``
    (2000) index rows. It then answers ``has_more: false`` whatever it did not scan: an org with more than 2000
    stored completions in the window that lists ``metadata[tag]=x`` gets an empty (or short) page claiming to be
    complete, and its matching older completions are unreachable (no cursor to go on from either). Shown with
    the limit lowered to 10 and 30 completions (one index batch is 20 rows). (completions.py page:
    ``Page(found[:limit], len(found) > limit)`` ignores ``scanned >= SCAN_LIMIT``.)"""
    monkeypatch.setattr(completions, "SCAN_LIMIT", 10)
    org = f"org-review-{uuid.uuid4().hex[:8]}"
    now = datetime.now(UTC)
    wanted = stored(org, now - timedelta(minutes=30), tag="rare")
    await store.write(wanted)
    for i in range(29):
        await store.write(stored(org, now - timedelta(minutes=29 - i)))
    page = await store.page(org, after=None, limit=5, ascending=False, model=None, metadata={"tag": "rare"})
    found = [row["completion_id"] for row in page.items]
    assert found == [wanted.completion_id] or page.has_more, (
        f"the listing claims to be complete ({found}, has_more={page.has_more}) but a matching completion exists")


async def test_a_listing_early_in_march_includes_live_completions_of_late_january(
        store: CompletionStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """A listing reads this month's and last month's index partitions only (``months = [previous_month(now),
    now]``), on the claim that the 30-day TTL bounds the rest. After a February (28 or 29 days) that is false: a
    completion created on January 30 or 31 is live (GET by id finds it) until March 1 or 2, but a listing on
    March 1 reads only 2027-03 and 2027-02 and never shows it. (completions.py page, previous_month.)"""
    org = f"org-review-{uuid.uuid4().hex[:8]}"
    january = stored(org, datetime(2027, 1, 31, 12, 0, tzinfo=UTC))
    await store.write(january)
    monkeypatch.setattr(completions, "utcnow", lambda: datetime(2027, 3, 1, 12, 0, tzinfo=UTC))
    assert await store.get(january.completion_id, org) is not None  # live: retrieved by id
    page = await store.page(org, after=None, limit=20, ascending=False, model=None, metadata={})
    assert [row["completion_id"] for row in page.items] == [january.completion_id]
