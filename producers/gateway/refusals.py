"""Requests refused at admission (429), counted per key and reported to the abuse detector in batches.

A refusal must stay cheap (it is the answer a flood gets), so it is only counted here, in memory; once per
``every_s`` the counts of the keys refused since the last report go to ``llm.requests.refused.v1``, one event per
key, produced together. A client hammering through its 429s is thus visible to the abuse detector within a report
interval, and no refusal waits for Kafka. Counts not yet reported when the gateway stops are reported on stop; a
gateway that dies loses at most one interval's counts (a signal, not a bill).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError

from runtime.settings import KafkaSettings
from runtime.tenancy import ApiKey
from schemas.codec import codec_for
from schemas.events import RequestsRefused
from schemas.topics import TOPICS

log = logging.getLogger(__name__)

_CODEC = codec_for(RequestsRefused)


@dataclass
class _Count:
    org_id: str
    tier: str
    refused: int
    first_at: float
    last_at: float


class RefusalReport:
    """Counts refusals per key (``note``, O(1), no I/O) and reports them every ``every_s`` (``start``/``stop``)."""

    def __init__(self, producer: AIOKafkaProducer, kafka: KafkaSettings, gateway_id: str, *, every_s: float = 1.0,
                 clock: Callable[[], float] | None = None) -> None:
        self._producer = producer
        self._topic = kafka.topic(TOPICS.requests_refused.name)
        self._gateway_id = gateway_id
        self._every_s = every_s
        self._clock = clock or (lambda: datetime.now(UTC).timestamp())
        #: key id -> its refusals since the last report (bounded by the keys refused within one interval)
        self._counts: dict[str, _Count] = {}
        self._task: asyncio.Task[None] | None = None

    def note(self, key: ApiKey) -> None:
        now = self._clock()
        count = self._counts.get(key.key_id)
        if count is None:
            self._counts[key.key_id] = _Count(key.org_id, key.tier, 1, now, now)
        else:
            count.refused += 1
            count.last_at = now

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="refusal-report")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await self.report()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._every_s)
            await self.report()

    async def report(self) -> int:
        """Produce one event per key refused since the last report; returns how many. A failed produce drops that
        interval's counts (logged): they are a signal, and the next interval reports afresh."""
        counts, self._counts = self._counts, {}
        if not counts:
            return 0
        events = [RequestsRefused(key_id=key_id, org_id=c.org_id, tier=c.tier, refused=c.refused,
                                  first_at=datetime.fromtimestamp(c.first_at, UTC),
                                  last_at=datetime.fromtimestamp(c.last_at, UTC), gateway_id=self._gateway_id)
                  for key_id, c in counts.items()]
        try:
            sent = [await self._producer.send(self._topic, _CODEC.encode(e), key=e.key_id.encode()) for e in events]
        except KafkaError as exc:
            log.warning("refusal counts not reported", extra={"keys": len(events), "error": repr(exc)})
            return 0
        failed = [r for r in await asyncio.gather(*sent, return_exceptions=True) if isinstance(r, BaseException)]
        if failed:
            log.warning("refusal counts not reported", extra={"keys": len(failed), "error": repr(failed[0])})
        return len(events) - len(failed)
