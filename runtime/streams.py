"""Where each request's stream lives, known to every gateway: the mechanism behind resuming a stream anywhere.

Every token of a request is on its reply partition of the token topic (kept a day). A gateway accepting a request
writes a *stream record* to Redis before the client sees a byte: whose it is (org, user), which reply partition
carries its tokens and an offset at or before its first token event, and what its client was promised (model,
creation time, usage chunk). Any gateway can then serve the rest of the stream from the log, after the accepting
one died or stopped: chat completions (``Last-Event-ID``) and the Responses API (``starting_after``) alike.

A stream record lives ``resume_ttl_s``; a request id without one, or another org's, is answered 404. A resuming
gateway names itself the stream's *listener* (for operators; the workers learn of a resume from the control topic,
``inference_workers/listeners.py``).

Positions: a stream's events are numbered by the deltas its merge accepts (``schemas/token_stream.py``), which
every reader of the log computes alike, whatever it coalesced into one chunk: 0 is the stream's start (the role
chunk), ``k`` the end of its ``k``-th delta, and past the last delta ``K`` come the finish (``K + 1``) and the
usage (``K + 2``). An SSE event's id is ``<request id>:<position>``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from runtime.redis_client import key, request_claim_key
from runtime.settings import RedisSettings

#: what an event id looks like: ``chatcmpl-…:12``
ID_SEPARATOR = ":"
#: ASCII digits only (``str.isdigit`` takes '²', which ``int`` refuses)
_POSITION = re.compile(r"[0-9]{1,9}")


@dataclass(frozen=True)
class StreamRecord:
    request_id: str
    org_id: str
    partition: int
    #: an offset of the reply partition at or before the request's first token event
    from_offset: int
    model: str
    #: the ``created`` of every chunk (Unix seconds), as the accepting gateway sent it
    created: int
    include_usage: bool
    #: the gateway process that accepted it
    gateway_id: str
    user: str = ""
    #: the request's queue deadline (Unix seconds; 0: unknown): a resumed stream waits for its first token as long
    deadline_at: float = 0.0
    #: what a Responses API stream needs to be served again (its response object, JSON); empty for a chat stream
    extra: str = ""
    #: the writer stores its outcome (``store``), and the conversation its turn is appended to: a gateway relaying
    #: its final notes them for read-your-writes (``producers/gateway/pending_writes.py``)
    store: bool = False
    conversation_id: str = ""

    def to_redis(self) -> Mapping[Any, Any]:
        return {"org": self.org_id, "partition": self.partition, "from": self.from_offset, "model": self.model,
                "created": self.created, "usage": int(self.include_usage), "gateway": self.gateway_id,
                "user": self.user, "deadline": self.deadline_at, "extra": self.extra, "store": int(self.store),
                "conversation": self.conversation_id}

    @classmethod
    def from_redis(cls, request_id: str, data: Mapping[Any, Any]) -> StreamRecord | None:
        try:
            return cls(request_id, data["org"], int(data["partition"]), int(data["from"]), data["model"],
                       int(data["created"]), data.get("usage") == "1", data["gateway"], data.get("user", ""),
                       float(data.get("deadline", 0)), data.get("extra", ""), data.get("store") == "1",
                       data.get("conversation", ""))
        except (KeyError, ValueError):
            return None  # partly written (a Redis restart between fields cannot happen: one HSET), or foreign


def event_id(request_id: str, position: int) -> str:
    return f"{request_id}{ID_SEPARATOR}{position}"


def parse_event_id(value: str) -> tuple[str, int] | None:
    """``(request id, position)`` of an SSE event id; None when it is not one of ours."""
    request_id, sep, position = value.strip().rpartition(ID_SEPARATOR)
    if not sep or not request_id or not _POSITION.fullmatch(position):
        return None
    return request_id, int(position)


class StreamDirectory:
    def __init__(self, redis: Redis, settings: RedisSettings, *, ttl_s: float) -> None:
        self._redis = redis
        self._settings = settings
        self._ttl_ms = int(ttl_s * 1000)
        self._record = redis.register_script(_RECORD)

    def _key(self, request_id: str) -> str:
        return key(self._settings, "stream", request_id)

    async def record(self, stream: StreamRecord) -> None:
        # One script, not a MULTI/HSET/PEXPIRE/EXEC pipeline: a fifth of the request's Redis work on the gateway's
        # event loop was that pipeline's client-side cost (a pooled connection each, four commands to pack and parse)
        fields = [item for pair in stream.to_redis().items() for item in pair]
        await self._record(keys=[self._key(stream.request_id)], args=[self._ttl_ms, *fields])

    async def lookup(self, request_id: str) -> StreamRecord | None:
        return StreamRecord.from_redis(request_id, await self._redis.hgetall(self._key(request_id)))

    async def forget(self, request_id: str) -> None:
        """The stream can no longer be resumed (its response was deleted)."""
        await self._redis.delete(self._key(request_id))

    async def finished(self, request_id: str) -> bool:
        """Whether the request's generation has ended and been committed (its claim says ``done``)."""
        return bool(await self._redis.hexists(request_claim_key(self._settings, request_id), "done"))

    async def listen(self, request_id: str, gateway_id: str) -> None:
        """This gateway process now serves the stream (``XX``-like: a record gone meanwhile stays gone)."""
        await self._redis.eval(_LISTEN, 1, self._key(request_id), gateway_id)

    async def listeners(self, request_ids: list[str]) -> list[str | None]:
        """The gateway process that resumed each stream (None: none did)."""
        async with self._redis.pipeline(transaction=False) as pipe:
            for request_id in request_ids:
                pipe.hget(self._key(request_id), "listener")
            return list(await pipe.execute())


_RECORD = """
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
redis.call('PEXPIRE', KEYS[1], ARGV[1])
"""

_LISTEN = """
if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('HSET', KEYS[1], 'listener', ARGV[1]) return 1 end
return 0
"""
