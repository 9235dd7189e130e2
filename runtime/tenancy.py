"""The tenancy registry as every gateway (and the abuse detector) sees it: both compacted registry topics, read from
the beginning and followed, in memory; and the limits an org is granted (its tier's, each overridden by its own).

Nothing on the request path asks Cassandra or Redis who a key is: a revocation is one record on the key topic,
applied by every gateway within its fetch latency. A lookup that misses first catches up with the topics' end
offsets (one coalesced round trip for every miss waiting at that moment), so a key created a moment ago on any
gateway works at once, and an unknown key is only refused after the view is known to be current.

A secret still unknown after such a round is remembered as missed (``MISS_TTL_S``, at most ``MAX_MISSES`` hashes,
the oldest forgotten first): presented again meanwhile it is refused at once, so a flood of one bad key (a leaked
or revoked key retried by a script, a typo in a deployment) costs no Kafka round trip per request. A key record
applied for a remembered hash forgets it, so a secret registered after it was tried (only ``register_secret`` can
do that: issued secrets are new random ones) works as soon as this gateway applied its record; a key issued
anywhere still works on every gateway at once. A flood of distinct bad keys shares the coalesced rounds: one
ListOffsets in flight per gateway, whatever the flood.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError
from pydantic import ValidationError

from runtime.dead_letters import DeadLetters
from runtime.kafka_clients import all_partitions, make_consumer, stop_consumer
from runtime.limiter import Limits
from runtime.settings import KafkaSettings, TierTable
from schemas.codec import codec_for
from schemas.errors import DecodeError
from schemas.events import ChatRequest, KeyRecord, OrgRecord, utcnow
from schemas.topics import TOPICS, TopicSpec

log = logging.getLogger(__name__)

_ORGS = codec_for(OrgRecord)
#: the follow loop confirms the view is current this often; /health turns red when it has not been for a while
CONFIRM_EVERY_S = 2.0
STALE_AFTER_S = 10.0
#: how long a secret found in no key record after a catch-up is refused without another, and how many are kept
MISS_TTL_S = 10.0
MAX_MISSES = 10_000
_KEYS = codec_for(KeyRecord)


def limits_for(org: OrgRecord, tiers: TierTable) -> Limits:
    """The limits the org is granted, each of its keys alike: its tier's, each overridden by the org's own."""
    policy, own = tiers.policy(org.tier), org.limits
    return Limits(
        requests_per_minute=own.requests_per_minute or policy.requests_per_minute,
        tokens_per_minute=own.tokens_per_minute or policy.tokens_per_minute,
        max_concurrent=own.max_concurrent or policy.max_concurrent,
    )


def work_queue(request: ChatRequest, tiers: TierTable) -> TopicSpec:
    """Where an admitted request goes: the work queue of its tier's priority class
    (``KNS_TENANCY__TIERS__<TIER>__PRIORITY`` moves a tier to another class); the gateway and the safety pre-filter
    route alike."""
    return TOPICS.admitted(tiers.policy(request.tier).priority)


@dataclass(frozen=True)
class ApiKey:
    """A caller, as the request path needs it: the key and the org it bills to."""

    key: KeyRecord
    org: OrgRecord

    @property
    def key_id(self) -> str:
        return self.key.key_id

    @property
    def org_id(self) -> str:
        return self.org.org_id

    @property
    def tier(self) -> str:
        return self.org.tier

    def allows_model(self, model: str) -> bool:
        return not self.key.models or model in self.key.models

    def may_see(self, org_id: str, model: str) -> bool:
        """Whether the key may resume, read or cancel what ``model`` generated for ``org_id``: its own org's, of a
        model its allow-list admits. Anything else is answered as not found (404), as another org's is."""
        return org_id == self.org_id and self.allows_model(model)


class Refusal(enum.Enum):
    """Why a secret does not authenticate."""

    UNKNOWN = "unknown"
    REVOKED = "revoked"
    EXPIRED = "expired"


class TenancyView:
    def __init__(self, kafka: KafkaSettings, *, dead_letters: DeadLetters | None = None,
                 catch_up_timeout_s: float = 2.0, miss_ttl_s: float = MISS_TTL_S, max_misses: int = MAX_MISSES,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._kafka = kafka
        #: key hash -> when a catch-up found no record of it (see the module's docstring), oldest first
        self._misses: OrderedDict[str, float] = OrderedDict()
        self._miss_ttl_s = miss_ttl_s
        self._max_misses = max_misses
        self._clock = clock
        self._dead_letters = dead_letters
        self._timeout = catch_up_timeout_s
        self._org_topic = kafka.topic(TOPICS.orgs.name)
        self._key_topic = kafka.topic(TOPICS.keys.name)
        self.orgs: dict[str, OrgRecord] = {}
        self.keys: dict[str, KeyRecord] = {}
        self._hashes_of: dict[str, set[str]] = defaultdict(set)
        self._consumer: AIOKafkaConsumer | None = None
        self._task: asyncio.Task[None] | None = None
        self._partitions: list[TopicPartition] = []
        self._applied: dict[TopicPartition, int] = {}
        self._advanced = asyncio.Condition()
        self._round: asyncio.Task[bool] | None = None
        self._next_round: asyncio.Task[bool] | None = None
        #: when the view was last known to be current (a catch-up round succeeded)
        self._current_at = 0.0
        self._confirming: asyncio.Task[bool] | None = None

    # --- lifecycle ------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Read both topics to their end, then follow them."""
        consumer = make_consumer(self._kafka, role="tenancy", isolation="read_committed")
        await consumer.start()
        self._consumer = consumer
        self._partitions = (await all_partitions(consumer, self._org_topic)
                            + await all_partitions(consumer, self._key_topic))
        consumer.assign(self._partitions)
        await consumer.seek_to_beginning(*self._partitions)
        self._applied = {tp: 0 for tp in self._partitions}
        self._task = asyncio.create_task(self._follow(), name="tenancy-view")
        if not await self.catch_up(timeout_s=max(self._timeout, 30.0)):
            raise TimeoutError("the tenancy registry topics could not be read to their end")
        log.info("tenancy view ready", extra={"orgs": len(self.orgs), "keys": len(self.keys)})

    async def stop(self) -> None:
        tasks = [t for t in (self._task, self._round, self._next_round, self._confirming) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._consumer is not None:
            await stop_consumer(self._consumer)

    @property
    def healthy(self) -> bool:
        """Following, and known to be current within the last few confirmations (a broker that stopped answering
        makes the fetches come back empty, not fail: silence is not proof of being current)."""
        following = self._task is not None and not self._task.done()
        return following and time.monotonic() - self._current_at < STALE_AFTER_S

    # --- reads ----------------------------------------------------------------------------------------

    async def authenticate(self, key_hash: str) -> ApiKey | Refusal:
        """The caller behind ``key_hash``, or why it is refused ."""
        found = self._resolve(key_hash)
        if found != Refusal.UNKNOWN or self._missed_lately(key_hash):
            return found
        current = await self.catch_up()
        found = self._resolve(key_hash)
        if found == Refusal.UNKNOWN and current:
            self._missed(key_hash)
        return found

    def _missed_lately(self, key_hash: str) -> bool:
        at = self._misses.get(key_hash)
        if at is None:
            return False
        if self._clock() - at < self._miss_ttl_s:
            return True
        del self._misses[key_hash]
        return False

    def _missed(self, key_hash: str) -> None:
        self._misses[key_hash] = self._clock()
        self._misses.move_to_end(key_hash)
        while len(self._misses) > self._max_misses:
            self._misses.popitem(last=False)

    def _resolve(self, key_hash: str) -> ApiKey | Refusal:
        key = self.keys.get(key_hash)
        org = self.orgs.get(key.org_id) if key is not None else None
        if key is None or org is None:
            return Refusal.UNKNOWN
        now = utcnow()
        if key.revoked_by(now):
            return Refusal.REVOKED
        if key.expired_by(now):
            return Refusal.EXPIRED
        return ApiKey(key, org)

    def keys_of(self, key_id: str) -> list[KeyRecord]:
        """Every secret of a key id (two while a rotation's grace lasts), newest first."""
        records = [self.keys[h] for h in self._hashes_of.get(key_id, ())]
        return sorted(records, key=lambda r: r.created_at, reverse=True)

    def keys_of_org(self, org_id: str) -> list[KeyRecord]:
        return sorted((k for k in self.keys.values() if k.org_id == org_id), key=lambda r: r.created_at)

    # --- following ------------------------------------------------------------------------------------

    async def catch_up(self, timeout_s: float | None = None) -> bool:
        """Wait until everything committed before this call is applied. Callers share rounds of one end-offset
        request each; a caller arriving while a round is under way waits for the next one (the current round may
        have read the end offsets before the caller's record was written). False when the round took longer than
        its timeout (the view may be behind)."""
        timeout = timeout_s or self._timeout
        if self._round is None or self._round.done():
            self._round = asyncio.create_task(self._catch_up(timeout))
            return await asyncio.shield(self._round)
        if self._next_round is None or self._next_round.done():
            self._next_round = asyncio.create_task(self._after(self._round, timeout))
        return await asyncio.shield(self._next_round)

    async def _after(self, previous: asyncio.Task[bool], timeout_s: float) -> bool:
        await asyncio.wait([previous])
        self._round, self._next_round = self._next_round, None
        return await self._catch_up(timeout_s)

    async def _catch_up(self, timeout_s: float) -> bool:
        assert self._consumer is not None
        try:
            async with asyncio.timeout(timeout_s):
                ends = await self._consumer.end_offsets(self._partitions)
                await self.reached(ends)
        except (TimeoutError, KafkaError) as exc:
            log.warning("tenancy view behind its topics", extra={"timeout_s": timeout_s, "error": repr(exc)})
            return False
        self._current_at = time.monotonic()
        return True

    async def reached(self, offsets: dict[TopicPartition, int]) -> None:
        """Wait until the view has applied every record below these offsets."""
        async with self._advanced:
            await self._advanced.wait_for(
                lambda: all(self._position(tp) >= end for tp, end in offsets.items()))

    def _position(self, tp: TopicPartition) -> int:
        return self._applied.get(tp, 0)

    async def _follow(self) -> None:
        assert self._consumer is not None
        consumer = self._consumer
        while True:
            try:
                batch = await consumer.getmany(timeout_ms=500)
            except KafkaError as exc:
                # Known keys keep working from memory while the broker is away; misses wait for it.
                log.warning("tenancy registry unreachable", extra={"error": repr(exc)})
                await asyncio.sleep(1.0)
                continue
            for tp, records in batch.items():
                for record in records:
                    problem = self._apply(tp, record.key, record.value)
                    if problem is not None:
                        log.error("undecodable tenancy record",
                                  extra={"topic": tp.topic, "offset": record.offset, "error": problem})
                        if self._dead_letters is not None:
                            await self._dead_letters.send(record, problem)
            # Positions advance past transaction markers and compacted gaps too, not only past records.
            for tp in self._partitions:
                self._applied[tp] = max(self._applied[tp], await consumer.position(tp))
            async with self._advanced:
                self._advanced.notify_all()
            confirming = self._confirming is not None and not self._confirming.done()
            if time.monotonic() - self._current_at > CONFIRM_EVERY_S and not confirming:
                self._confirming = asyncio.create_task(self.catch_up())

    def _apply(self, tp: TopicPartition, key: bytes | None, value: bytes | None) -> str | None:
        try:
            if tp.topic == self._org_topic:
                if value is None:  # a tombstone: the org is gone
                    self.orgs.pop((key or b"").decode(), None)
                    return None
                org = _ORGS.decode(value)
                self.orgs[org.org_id] = org
                return None
            if value is None:
                self._forget_key((key or b"").decode())
                return None
            record = _KEYS.decode(value)
        except (DecodeError, ValidationError, UnicodeDecodeError) as exc:
            return f"undecodable: {exc}"
        self._forget_key(record.key_hash)
        self._misses.pop(record.key_hash, None)
        self.keys[record.key_hash] = record
        self._hashes_of[record.key_id].add(record.key_hash)
        return None

    def _forget_key(self, key_hash: str) -> None:
        old = self.keys.pop(key_hash, None)
        if old is not None:
            self._hashes_of[old.key_id].discard(key_hash)
