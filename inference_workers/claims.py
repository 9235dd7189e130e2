"""Request claims in Redis: who generates a request id, under which attempt, whatever Kafka redelivers.

An attempt is numbered by the consumer-group *generation* in which its worker was assigned the request's
partition: every change of ownership happens in a newer generation, so a newer owner's attempt always outranks an
older owner's, in the relay's merge as here, with no counter to lose in a Redis restart.

The first record carrying a request id claims it (its topic/partition/offset is the claim's source). A later
record with the same id but another source is a duplicate (a retried upstream send) and is skipped. The same
record coming back (a partition moved, a worker died) is either finished — the claim is marked done once the
commit is through — and skipped, or started before: the caller takes it over (continues from what it emitted).
A claim from an older generation than the claim's current attempt is *stale*: the caller is a worker that lost
the partition without knowing yet (a stall past the session timeout) and must not touch the request. The
commit's own offset metadata (``offsets.py``) says which requests finished exactly; the claim is what catches a
duplicate record, fences a stale worker, and records where the request's token events start.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from redis.asyncio import Redis

from runtime.redis_client import request_claim_key
from runtime.settings import RedisSettings

# KEYS[1]: claim hash. ARGV: source, ttl_s, worker, org, key, attempt (generation).
# Returns {verdict, the attempt that ran before this one (0: none)}.
_CLAIM = """
local src = redis.call('HGET', KEYS[1], 'src')
local mine = tonumber(ARGV[6])
if not src then
  redis.call('HSET', KEYS[1], 'src', ARGV[1], 'attempt', mine, 'before', 0, 'worker', ARGV[3], 'org', ARGV[4],
             'key', ARGV[5])
  redis.call('EXPIRE', KEYS[1], ARGV[2])
  return {'start', 0}
end
if src ~= ARGV[1] then return {'duplicate', 0} end
if redis.call('HEXISTS', KEYS[1], 'done') == 1 then return {'done', 0} end
local current = tonumber(redis.call('HGET', KEYS[1], 'attempt')) or 0
if current == mine and redis.call('HGET', KEYS[1], 'worker') == ARGV[3] then
  return {'start', tonumber(redis.call('HGET', KEYS[1], 'before')) or 0}
end
if current >= mine then return {'stale', current} end
redis.call('HSET', KEYS[1], 'attempt', mine, 'before', current, 'worker', ARGV[3])
return {'start', current}
"""

# KEYS[1]: claim hash. ARGV: field, value, ttl_s, HSET|HSETNX. A claim lost in a Redis restart and written again
# here expires like any other (EXPIRE NX: an existing expiry is kept).
_SET_FIELD = """
redis.call(ARGV[4], KEYS[1], ARGV[1], ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[3], 'NX')
return 1
"""


class ClaimVerdict(enum.Enum):
    START = "start"
    DUPLICATE = "duplicate"
    DONE = "done"
    STALE = "stale"


@dataclass(frozen=True)
class Claim:
    verdict: ClaimVerdict
    #: START: the attempt that ran before (0: none, a fresh request); STALE: the newer attempt that has it
    previous: int = 0


class RequestClaims:
    def __init__(self, redis: Redis, settings: RedisSettings, *, worker_id: str, ttl_s: int) -> None:
        self._redis = redis
        self._settings = settings
        self._worker = worker_id
        self._ttl = ttl_s
        self._claim = redis.register_script(_CLAIM)
        self._set_field = redis.register_script(_SET_FIELD)

    def _key(self, request_id: str) -> str:
        return request_claim_key(self._settings, request_id)

    async def claim(self, request_id: str, source: str, attempt: int, *, org_id: str = "", key_id: str = ""
                    ) -> Claim:
        """Claim a request for generation as ``attempt`` (this worker's group generation for the partition).
        The claim also records whose request it is (org, key): the safety post-filter reads that."""
        verdict, previous = await self._claim(keys=[self._key(request_id)],
                                              args=[source, self._ttl, self._worker, org_id, key_id, attempt])
        return Claim(ClaimVerdict(verdict), int(previous))

    async def record_first_offset(self, request_id: str, offset: int) -> None:
        """Where the request's token events start on its reply partition (the first recorded stays): a
        takeover, and a client resuming elsewhere, read from there."""
        await self._set_field(keys=[self._key(request_id)], args=["first_offset", offset, self._ttl, "HSETNX"])

    async def first_offset(self, request_id: str) -> int | None:
        value = await self._redis.hget(self._key(request_id), "first_offset")
        return None if value is None else int(value)

    async def mark_done(self, request_ids: list[str]) -> None:
        async with self._redis.pipeline(transaction=False) as pipe:
            for request_id in request_ids:
                await self._set_field(keys=[self._key(request_id)], args=["done", 1, self._ttl, "HSET"], client=pipe)
            await pipe.execute()
