"""Request claims in Redis: generate each request id once, whatever Kafka redelivers.

The first record carrying a request id claims it (its topic/partition/offset is the claim's source). A later
record with the same id but another source is a duplicate (a retried upstream send) and is skipped. The same
record coming back (a rebalance or a crash before its offset was committed) is either finished — the claim
is marked done once the worker's transaction commits — and skipped, or was interrupted and is generated
again with ``attempt + 1``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from redis.asyncio import Redis

from runtime.redis_client import key
from runtime.settings import RedisSettings

# KEYS[1]: claim hash. ARGV: source, ttl_s, worker, org, key
_CLAIM = """
local src = redis.call('HGET', KEYS[1], 'src')
if not src then
  redis.call('HSET', KEYS[1], 'src', ARGV[1], 'attempt', 1, 'worker', ARGV[3], 'org', ARGV[4], 'key', ARGV[5])
  redis.call('EXPIRE', KEYS[1], ARGV[2])
  return {'start', 1}
end
if src ~= ARGV[1] then return {'duplicate', 0} end
if redis.call('HEXISTS', KEYS[1], 'done') == 1 then return {'done', 0} end
local attempt = redis.call('HINCRBY', KEYS[1], 'attempt', 1)
redis.call('HSET', KEYS[1], 'worker', ARGV[3])
return {'start', attempt}
"""


class ClaimVerdict(enum.Enum):
    START = "start"
    DUPLICATE = "duplicate"
    DONE = "done"


@dataclass(frozen=True)
class Claim:
    verdict: ClaimVerdict
    attempt: int


class RequestClaims:
    def __init__(self, redis: Redis, settings: RedisSettings, *, worker_id: str, ttl_s: int) -> None:
        self._redis = redis
        self._settings = settings
        self._worker = worker_id
        self._ttl = ttl_s
        self._claim = redis.register_script(_CLAIM)

    def _key(self, request_id: str) -> str:
        return key(self._settings, "request", request_id)

    async def claim(self, request_id: str, source: str, *, org_id: str = "", key_id: str = "") -> Claim:
        """Claim a request for generation. The claim also records whose request it is (org, key): the safety
        post-filter reads that to attribute a halt."""
        verdict, attempt = await self._claim(keys=[self._key(request_id)],
                                             args=[source, self._ttl, self._worker, org_id, key_id])
        return Claim(ClaimVerdict(verdict), int(attempt))

    async def mark_done(self, request_ids: list[str]) -> None:
        async with self._redis.pipeline(transaction=False) as pipe:
            for request_id in request_ids:
                pipe.hset(self._key(request_id), "done", 1)
            await pipe.execute()
