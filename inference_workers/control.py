"""Every worker reads the whole control topic (no consumer group): a cancel, halt, attach or detach names a request
id, and only the worker generating it acts. Events are read from a short look-back at start-up, so a cancel that
arrived while its request still waited in the backlog is not missed, nor the client connections of a stream a
worker takes over (``listeners.py``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable

from aiokafka import AIOKafkaConsumer, ConsumerRecord

from runtime.dead_letters import DeadLetters
from runtime.kafka_clients import all_partitions, consume, make_consumer, stop_consumer
from runtime.settings import KafkaSettings
from schemas.codec import codec_for
from schemas.errors import DecodeError
from schemas.events import ORIGIN_ATTACHMENT, ControlEvent

log = logging.getLogger(__name__)


class RecentControls:
    """Bounded memory of control events by request id, for requests not started here yet: a cancel that came while
    the request waited in the backlog, and the client connections a takeover inherits. Per request it keeps the
    latest stop and each connection's latest event (attached, or detached with its report): however often a client
    drops and resumes, what a takeover needs stays, in the order the connections last changed."""

    #: connections remembered per request (the oldest forgotten first): far more than a client resumes in a window
    PER_REQUEST = 64

    def __init__(self, capacity: int = 50_000) -> None:
        self._events: OrderedDict[str, _Remembered] = OrderedDict()
        self._capacity = capacity

    def remember(self, event: ControlEvent) -> None:
        remembered = self._events.get(event.request_id)
        if remembered is None:
            remembered = self._events[event.request_id] = _Remembered()
        if event.stops:
            remembered.stop = event
        if event.attachment is not None or not event.stops:
            name = event.attachment or f"@{event.issued_by}"
            remembered.connections.pop(name, None)
            remembered.connections[name] = event
            while len(remembered.connections) > self.PER_REQUEST:
                # the oldest resume's goes; the accepting connection's never (a takeover must know it detached)
                oldest = next(n for n in remembered.connections if n != ORIGIN_ATTACHMENT)
                remembered.connections.pop(oldest)
        elif event.delivered_tokens is not None:  # a v2 gateway's cancel: its connection ended
            remembered.connections[f"@{event.issued_by}"] = event
        self._events.move_to_end(event.request_id)
        while len(self._events) > self._capacity:
            self._events.popitem(last=False)

    def stop(self, request_id: str) -> ControlEvent | None:
        """The latest cancel or halt of the request, if any."""
        remembered = self._events.get(request_id)
        return remembered.stop if remembered is not None else None

    def history(self, request_id: str) -> list[ControlEvent]:
        """Each connection's latest event, in the order they last changed (a cancel naming one counts as its end)."""
        remembered = self._events.get(request_id)
        return list(remembered.connections.values()) if remembered is not None else []


class _Remembered:
    __slots__ = ("connections", "stop")

    def __init__(self) -> None:
        self.stop: ControlEvent | None = None
        self.connections: dict[str, ControlEvent] = {}


class ControlListener:
    def __init__(self, kafka: KafkaSettings, topic: str, lookback_s: float,
                 on_event: Callable[[ControlEvent], None], dead_letters: DeadLetters | None = None) -> None:
        self._kafka = kafka
        self._topic = topic
        self._lookback_s = lookback_s
        self._on_event = on_event
        self._dead_letters = dead_letters
        self._consumer: AIOKafkaConsumer | None = None
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        consumer = make_consumer(self._kafka, role="worker-control", follower=True)
        await consumer.start()
        try:
            await self._start_from_lookback(consumer)
        except BaseException:
            # Kafka away longer than a request's timeout: the worker stops, nothing left open
            await stop_consumer(consumer)
            raise
        self._consumer = consumer
        self._task = asyncio.create_task(
            consume(consumer, codec_for(ControlEvent), self._handle, stop=self._stop,
                    undecodable=self._undecodable if self._dead_letters else None),
            name="control-listener",
        )

    async def _start_from_lookback(self, consumer: AIOKafkaConsumer) -> None:
        """Position every partition at the look-back's first event. Both offsets are looked up before the
        consumer fetches (a lookup behind its parked long poll would wait it out), the ends first: an event
        written after that lookup is at or past its end, one written before it within the look-back is the
        times lookup's hit, so none falls between (``seek_to_end`` after the times lookup skipped one)."""
        partitions = await all_partitions(consumer, self._topic)
        ends = await consumer.end_offsets(partitions)
        since_ms = int((time.time() - self._lookback_s) * 1000)
        found = await consumer.offsets_for_times({tp: since_ms for tp in partitions})
        consumer.assign(partitions)
        for tp in partitions:
            hit = found.get(tp)
            # A hit past the end is an event written since the first lookup, stamped before the look-back by a
            # clock behind ours: what lies between was written since too, and is read.
            consumer.seek(tp, ends[tp] if hit is None else min(hit.offset, ends[tp]))

    async def _undecodable(self, record: ConsumerRecord[bytes, bytes], exc: DecodeError) -> None:
        assert self._dead_letters is not None
        await self._dead_letters.send(record, str(exc))

    async def _handle(self, event: ControlEvent, _record: ConsumerRecord[bytes, bytes]) -> None:
        self._on_event(event)

    @property
    def healthy(self) -> bool:
        return self._task is not None and not self._task.done()

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
        if self._consumer is not None:
            await stop_consumer(self._consumer)
