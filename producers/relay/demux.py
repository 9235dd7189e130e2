"""The SSE relay's demultiplexer: one consumer per tailed partition, one collector per request.

The gateway claims a reply partition, the relay tails it from its end (records before the gateway started
belong to requests whose clients are gone) and routes each token event to its request's collector.
Register a request *before* producing it and unregister in ``finally``. A worker writes one record per engine
step per reply partition, carrying the deltas of every request of that step (``schemas/token_batch.py``): the
feed decodes it once and hands each delta to its stream; deltas of unknown ids (a request whose client already
left) are counted and dropped, and a record of a single such request (keyed by its id) is not even decoded.

Resuming a stream (``runtime/streams.py``) registers it on the partition its tokens live on, from an offset at
or before its first event, on a feed of resumed streams of that partition (a second consumer, even for this
gateway's own partition, opened for as long as resumed streams are open): the live feed never goes back. A resume
from an offset that feed has passed by at most ``NEAR_REWIND`` records rewinds it; each stream remembers the next
offset it takes, so the streams already on the feed see no record twice. A resume further back gets a consumer of
its own (a catch-up, ``MAX_CATCH_UPS`` per process at once) that reads its backlog and hands the stream to the
feed once it has read as far: one client's far resume (up to the resume window back, repeated at will) never holds
back another's resumed stream, and a catch-up whose client left stops at once.

The relay reads ``read_uncommitted``: token deltas are not transactional (a transaction per token would
cost milliseconds each) and only a request's final event rides in the worker's transaction; waiting for
that transaction would stall every stream behind it. A final the client saw from a transaction that then
aborted is still the outcome: the worker retries the same commit, or the request's next owner finalizes what
the log shows (``inference_workers/prefix.py``). Which events count is the collector's
(``schemas/token_stream.py``). A record of an open stream that this gateway cannot decode is dead-lettered, and
its stream ends at once with an error rather than waiting out a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition

from producers.relay.collector import StreamCollector
from runtime.dead_letters import DeadLetters
from runtime.kafka_clients import make_consumer, stop_consumer
from runtime.metrics import KAFKA_HOP, RELAY_EVENTS, RELAY_STREAMS
from runtime.settings import KafkaSettings
from schemas.codec import codec_for
from schemas.errors import DecodeError
from schemas.events import ErrorCode, TokenEvent
from schemas.token_batch import events, may_carry

log = logging.getLogger(__name__)

#: a feed of resumed streams stays this long after its last one closed (a wave of resumes after a gateway died
#: arrives over a few seconds: one feed serves them all)
IDLE_FEED_S = 30.0
#: records routed between two yields to the event loop
YIELD_EVERY = 1000
#: a resume at most this many records behind its partition's feed of resumed streams rewinds that feed (a replay of
#: a few milliseconds for the feed's other streams); one further back reads its backlog on a consumer of its own
NEAR_REWIND = 1000
#: a feed streaming at most this many requests looks for their ids among a record's bytes before decoding it: a far
#: resume's catch-up reads thousands of other requests' records for one stream, and decoding each was most of the
#: gateway's CPU under a flood of far resumes (``kns bench flood``, py-spy); with more streams the look costs more
#: than the decode saves
FEW_STREAMS = 8
#: far resumes reading their backlog at once in one gateway process (each a consumer decoding its partition's
#: records); another waits for a turn, delaying no stream but its own
MAX_CATCH_UPS = 8


@dataclass
class _Sink:
    collector: StreamCollector
    #: the first offset this stream still takes (the records before it were merged already, or precede it)
    next_offset: int


class _Feed:
    """One partition, tailed for the streams registered on it."""

    def __init__(self, kafka: KafkaSettings, tp: TopicPartition, relay: Relay) -> None:
        self._kafka = kafka
        self.tp = tp
        self._relay = relay
        self.sinks: dict[str, _Sink] = {}
        #: the next offset to route: every record still to come is at or after it
        self.position = 0
        self._rewind_to: int | None = None
        self._stop = asyncio.Event()
        self._consumer: AIOKafkaConsumer | None = None
        self.task: asyncio.Task[None] | None = None
        self.idle_since: float | None = None
        self._codec = codec_for(TokenEvent)

    async def start(self, from_offset: int | None) -> None:
        """Tail from ``from_offset`` (None: the partition's end)."""
        consumer = make_consumer(self._kafka, role="relay", isolation="read_uncommitted",
                                 max_partition_fetch_bytes=4 * 1024 * 1024)
        await consumer.start()
        try:
            consumer.assign([self.tp])
            if from_offset is None:
                await consumer.seek_to_end(self.tp)
            else:
                consumer.seek(self.tp, from_offset)
            # Resolved now: a request produced after start() must not be missed.
            self.position = await consumer.position(self.tp)
        except BaseException:
            await stop_consumer(consumer)
            raise
        self._consumer = consumer
        self.task = asyncio.create_task(self._run(consumer), name=f"relay-{self.tp.partition}")
        log.info("relay tailing", extra={"topic": self.tp.topic, "partition": self.tp.partition,
                                         "offset": self.position})

    def add(self, request_id: str, collector: StreamCollector, from_offset: int | None) -> int:
        """Route the request's records from ``from_offset`` on (None: what is still to come). Returns it."""
        start = self.position if from_offset is None else from_offset
        if start < self.position:
            self._rewind_to = start if self._rewind_to is None else min(self._rewind_to, start)
        self.sinks[request_id] = _Sink(collector, start)
        self.idle_since = None
        return start

    async def _run(self, consumer: AIOKafkaConsumer) -> None:
        try:
            while not self._stop.is_set():
                await self._route_batch(consumer)
        except asyncio.CancelledError:
            raise
        except Exception:
            self._failed()
            raise

    async def _route_batch(self, consumer: AIOKafkaConsumer) -> None:
        """One fetch, routed (after the seek a resume asked for, if any)."""
        if self._rewind_to is not None:
            consumer.seek(self.tp, self._rewind_to)
            self.position, self._rewind_to = min(self.position, self._rewind_to), None
        batch = await consumer.getmany(self.tp, timeout_ms=200)
        for n, record in enumerate(batch.get(self.tp, ())):
            if self._rewind_to is not None:
                # A resume asked for records this fetch may be past: none is routed before the seek, or the
                # resumed stream would take a live record first and drop its own backlog.
                break
            await self._route(record)
            if n % YIELD_EVERY == YIELD_EVERY - 1:
                await asyncio.sleep(0)  # a large backlog must not hold the event loop for a whole fetch

    def _failed(self) -> None:
        log.exception("relay consumer failed; ending its open streams", extra={"partition": self.tp.partition})
        self.fail_all("the gateway's token relay failed", ErrorCode.GATEWAY_STOPPING)

    async def _route(self, record: ConsumerRecord[bytes, bytes]) -> None:
        self.position = max(self.position, record.offset + 1)
        if record.value is None:
            return
        keyed = self.sinks.get(record.key.decode(errors="replace")) if record.key is not None else None
        if record.key is not None and (keyed is None or record.offset < keyed.next_offset):
            self._relay.unknown.inc()  # one request's record, and nobody here streams it: not even decoded
            return
        if record.key is None and not self._may_carry_ours(record.value, record.offset):
            self._relay.unknown.inc()  # none of its requests is streamed here: not decoded either
            return
        try:
            fields = self._codec.decode_dict(record.value)
        except DecodeError as exc:
            await self._undecodable(record, keyed, exc)
            return
        if fields["emitted_at_us"]:
            self._relay.hop.observe(max(0.0, time.time() - fields["emitted_at_us"] / 1e6))
        taken: list[_Sink] = []
        routed = duplicate = unknown = 0
        for event in events(fields):  # one record per engine step: the deltas of every request on this partition
            sink = self.sinks.get(event.request_id)
            if sink is None or record.offset < sink.next_offset:
                unknown += 1
                continue
            taken.append(sink)
            if sink.collector.put(event):
                routed += 1
            else:
                duplicate += 1
        for sink in taken:  # after the whole record: it may carry several deltas of one request
            sink.next_offset = record.offset + 1
        self._relay.count(routed, duplicate, unknown)

    def _may_carry_ours(self, value: bytes, offset: int) -> bool:
        """False only when the record carries no event of a stream this feed still wants (a few streams only)."""
        if len(self.sinks) > FEW_STREAMS:
            return True
        return any(offset >= sink.next_offset and may_carry(value, request_id.encode())
                   for request_id, sink in self.sinks.items())

    async def _undecodable(self, record: ConsumerRecord[bytes, bytes], sink: _Sink | None, exc: DecodeError) -> None:
        """A record this gateway cannot read: the streams it carries end now. An unkeyed one may carry several
        requests: those whose id is among its bytes (``may_carry``; request ids are of one length, so one is never
        part of another)."""
        assert record.value is not None
        value = record.value
        carried = [sink] if sink is not None else [
            s for request_id, s in self.sinks.items()
            if record.offset >= s.next_offset and may_carry(value, request_id.encode())]
        for each in carried:
            each.next_offset = record.offset + 1
            each.collector.fail(f"this gateway cannot read a token event of the request ({exc})",
                                ErrorCode.UNDECODABLE_EVENT)
        if carried or self.sinks:
            await self._relay.dead_letter(record, str(exc))

    def fail_all(self, reason: str, code: str) -> None:
        for sink in self.sinks.values():
            sink.collector.fail(reason, code)

    @property
    def healthy(self) -> bool:
        return self.task is not None and not self.task.done()

    async def stop(self) -> None:
        self._stop.set()
        if self.task is not None:
            await asyncio.gather(self.task, return_exceptions=True)
        if self._consumer is not None:
            await stop_consumer(self._consumer)


class _CatchUp(_Feed):
    """A far resume's own consumer: reads its stream's backlog, then hands its streams to the partition's feed of
    resumed streams once it has read as far as that feed (``Relay._hand_over``); while that feed is closed it goes
    on alone. It ends as soon as it has no stream left (handed over, or its client left)."""

    def __init__(self, kafka: KafkaSettings, tp: TopicPartition, relay: Relay) -> None:
        super().__init__(kafka, tp, relay)
        #: its loop is over: it takes no stream any more
        self.ending = False

    async def _run(self, consumer: AIOKafkaConsumer) -> None:
        try:
            while not self._stop.is_set() and self.sinks:
                await self._route_batch(consumer)
                # Every record before the consumer's position has been routed (transaction markers included)
                self.position = max(self.position, await consumer.position(self.tp))
                if self._relay._hand_over(self):
                    break
        except asyncio.CancelledError:
            raise
        except Exception:
            self._failed()
            raise
        finally:
            # NOTE: the catch-up closes its own consumer and gives its turn back (Relay._catch_up_ended)
            self.ending = True
            self._relay._catch_up_ended(self)
            consumer, self._consumer = self._consumer, None
            if consumer is not None:
                await stop_consumer(consumer)


class Relay:
    def __init__(self, kafka: KafkaSettings, topic: str, partition: int,
                 dead_letters: DeadLetters | None = None) -> None:
        self._kafka = kafka
        self._dead_letters = dead_letters
        self.partition = TopicPartition(topic, partition)
        self._own = _Feed(kafka, self.partition, self)
        #: other gateways' partitions, tailed for resumed streams
        self._others: dict[int, _Feed] = {}
        self._opening: dict[int, asyncio.Future[_Feed]] = {}
        #: far resumes reading their backlog (``_CatchUp``), and the turns they take
        self._catch_ups: set[_CatchUp] = set()
        self._catch_up_turns = asyncio.Semaphore(MAX_CATCH_UPS)
        self._where: dict[str, _Feed] = {}
        self._janitor: asyncio.Task[None] | None = None
        self.hop = KAFKA_HOP.labels(hop="worker_to_relay")
        self.routed = RELAY_EVENTS.labels(kind="routed")
        self.unknown = RELAY_EVENTS.labels(kind="unknown_request")
        self.duplicate = RELAY_EVENTS.labels(kind="duplicate")

    async def start(self, from_offset: int | None = None) -> None:
        """Tail the partition from its end (``from_offset``: from there instead; benchmarks replay a backlog)."""
        await self._own.start(from_offset)
        self._janitor = asyncio.create_task(self._close_idle_feeds(), name="relay-janitor")

    @property
    def healthy(self) -> bool:
        return self._own.healthy

    @property
    def position(self) -> int:
        """An offset of this gateway's partition at or before every record still to come."""
        return self._own.position

    def register(self, request_id: str) -> StreamCollector:
        """A new request of this gateway: its records from now on."""
        return self._add(self._own, request_id, StreamCollector(request_id), None)

    async def resume(self, request_id: str, partition: int, from_offset: int, *, skip_through: int) -> StreamCollector:
        """An existing stream, merged from ``from_offset`` of ``partition``; its deltas through position
        ``skip_through`` are merged but not handed out (its client has them). Always on a feed of resumed streams,
        this gateway's own partition included, never the live one; a resume more than ``NEAR_REWIND`` records behind
        that feed reads its backlog on a catch-up first."""
        if request_id in self._where:
            raise ValueError(f"request {request_id} is already registered")
        feed = await self._feed(partition, from_offset)
        collector = StreamCollector(request_id, skip_through=skip_through)
        if feed.position - from_offset > NEAR_REWIND:
            return await self._catch_up(request_id, feed.tp, from_offset, collector)
        return self._add(feed, request_id, collector, from_offset)

    async def _catch_up(self, request_id: str, tp: TopicPartition, from_offset: int, collector: StreamCollector
                        ) -> StreamCollector:
        """A far resume: on a catch-up of its partition near its offset (one further back would make it wait while
        that one reads up to it), or on one of its own once a turn is free."""
        while True:
            for catch_up in self._catch_ups:
                if (catch_up.tp == tp and not catch_up.ending and catch_up.healthy
                        and abs(catch_up.position - from_offset) <= NEAR_REWIND):
                    return self._add(catch_up, request_id, collector, from_offset)
            if not self._catch_up_turns.locked():
                break
            async with self._catch_up_turns:  # wait for a turn, then look again: one may have opened meanwhile
                pass
        await self._catch_up_turns.acquire()
        catch_up = _CatchUp(self._kafka, tp, self)
        self._add(catch_up, request_id, collector, from_offset)  # before its first fetch
        try:
            await catch_up.start(from_offset)
        except BaseException:
            self.unregister(request_id)
            self._catch_up_turns.release()
            raise
        self._catch_ups.add(catch_up)
        return collector

    def _hand_over(self, catch_up: _CatchUp) -> bool:
        """A catch-up's streams to its partition's feed of resumed streams, once the catch-up has routed every record
        before that feed's position: from there on the feed routes them (what it passes below a stream's next offset
        is not routed again). False while the catch-up is behind, or the feed is closed."""
        feed = self._others.get(catch_up.tp.partition)
        if feed is None or not feed.healthy or catch_up.position < feed.position:
            return False
        for request_id, sink in catch_up.sinks.items():
            sink.next_offset = max(sink.next_offset, catch_up.position)
            feed.sinks[request_id] = sink
            self._where[request_id] = feed
        catch_up.sinks.clear()
        feed.idle_since = None
        return True

    def _catch_up_ended(self, catch_up: _CatchUp) -> None:
        if catch_up in self._catch_ups:
            self._catch_ups.discard(catch_up)
            self._catch_up_turns.release()

    def _add(self, feed: _Feed, request_id: str, collector: StreamCollector, from_offset: int | None
             ) -> StreamCollector:
        if request_id in self._where:
            raise ValueError(f"request {request_id} is already registered")
        collector.from_offset = feed.add(request_id, collector, from_offset)
        self._where[request_id] = feed
        RELAY_STREAMS.set(len(self._where))
        return collector

    async def _feed(self, partition: int, from_offset: int) -> _Feed:
        feed = self._others.get(partition)
        if feed is not None and feed.healthy:
            return feed
        opening = self._opening.get(partition)
        if opening is None:
            opening = self._opening[partition] = asyncio.ensure_future(self._open(partition, from_offset))
            opening.add_done_callback(lambda _: self._opening.pop(partition, None))
        return await asyncio.shield(opening)

    async def _open(self, partition: int, from_offset: int) -> _Feed:
        stale = self._others.pop(partition, None)
        if stale is not None:
            await stale.stop()
        feed = _Feed(self._kafka, TopicPartition(self.partition.topic, partition), self)
        await feed.start(from_offset)
        feed.idle_since = time.monotonic()  # closed when idle, even if the resume that opened it went away
        self._others[partition] = feed
        return feed

    def unregister(self, request_id: str) -> None:
        feed = self._where.pop(request_id, None)
        if feed is not None:
            feed.sinks.pop(request_id, None)
            if not feed.sinks:
                feed.idle_since = time.monotonic()
        RELAY_STREAMS.set(len(self._where))

    async def _close_idle_feeds(self) -> None:
        while True:
            await asyncio.sleep(IDLE_FEED_S / 3)
            now = time.monotonic()
            for partition, feed in list(self._others.items()):
                if not feed.sinks and feed.idle_since is not None and now - feed.idle_since > IDLE_FEED_S:
                    del self._others[partition]
                    await feed.stop()

    def count(self, routed: int, duplicate: int, unknown: int) -> None:
        """A record's tallies, counted once per record (a metric takes a lock: once per delta, it was a tenth of
        the relay's routing)."""
        for counter, n in ((self.routed, routed), (self.duplicate, duplicate), (self.unknown, unknown)):
            if n:
                counter.inc(n)

    async def dead_letter(self, record: ConsumerRecord[bytes, bytes], reason: str) -> None:
        if self._dead_letters is not None:
            await self._dead_letters.send(record, reason)

    def _feeds(self) -> list[_Feed]:
        return [self._own, *self._others.values(), *self._catch_ups]

    def streams(self) -> list[StreamCollector]:
        return [sink.collector for feed in self._feeds() for sink in feed.sinks.values()]

    async def stop(self) -> None:
        if self._janitor is not None:
            self._janitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._janitor
        for feed in self._feeds():
            await feed.stop()
            feed.fail_all("the gateway is shutting down", ErrorCode.GATEWAY_STOPPING)
