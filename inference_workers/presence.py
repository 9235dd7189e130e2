"""Stops generations nobody can receive: their gateway process is gone and no other gateway resumed them.

A gateway process announces itself with a liveness key in Redis (renewed with its reply-partition lease, see
``producers/relay/claim.py``); each request names the gateway process that accepted it
(``ReplyTo.gateway_id``), and a gateway that resumes a stream names itself the stream's listener
(``runtime/streams.py``). Every few seconds the worker looks up the gateways of what it is generating. A stream
whose accepting gateway and listener are both gone for ``grace_s`` — the window its client has to reconnect
elsewhere — is cancelled, billed for what was emitted while a gateway was last seen relaying it (a client resuming
later still gets the rest from the log, unbilled). When Redis cannot be asked, nothing is cancelled on a guess.
A background response is never cancelled so: it is generated to its end.

Only gateway ids of the form ``instance/incarnation`` announce themselves (older gateways did not): others are
never taken for gone.
"""

from __future__ import annotations

import asyncio
import logging
import time

from redis.asyncio import Redis
from redis.exceptions import RedisError

from inference_workers.intake import Intake, Job
from runtime.redis_client import gateway_alive_key
from runtime.settings import RedisSettings
from runtime.streams import StreamDirectory

log = logging.getLogger(__name__)


def announces_liveness(gateway_id: str) -> bool:
    return "/" in gateway_id


class GatewayPresence:
    def __init__(self, redis: Redis, settings: RedisSettings, intake: Intake, *, check_every_s: float,
                 grace_s: float, streams: StreamDirectory | None = None) -> None:
        self._redis = redis
        self._settings = settings
        self._intake = intake
        self._every = check_every_s
        self._grace = grace_s
        self._streams = streams
        self._unattended_since: dict[str, float] = {}
        #: the last listener seen for each stream: a live gateway relaying it stays its listener even if Redis lost
        #: the stream record (a restart, its TTL)
        self._listener: dict[str, str] = {}

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self._every)
            await self.check()

    async def check(self) -> None:
        # A background response is generated to its end whoever listens: its client polls or resumes later.
        jobs = [j for j in self._intake.jobs.values()
                if announces_liveness(j.request.reply.gateway_id) and not j.request.background]
        running = {j.request.request_id for j in jobs}
        self._unattended_since = {r: t for r, t in self._unattended_since.items() if r in running}
        self._listener = {r: g for r, g in self._listener.items() if r in running}
        if not jobs:
            return
        try:
            alive = await self._alive({j.request.reply.gateway_id for j in jobs})
            orphans = [j for j in jobs if not alive[j.request.reply.gateway_id]]
            listened = await self._listened(orphans)
        except (RedisError, OSError, TimeoutError):
            return  # unknown is not gone
        now = time.monotonic()
        for job in jobs:
            request_id = job.request.request_id
            if alive[job.request.reply.gateway_id] or request_id in listened:
                self._unattended_since.pop(request_id, None)
                self._intake.attended(request_id)
                continue
            since = self._unattended_since.setdefault(request_id, now)
            if now - since >= self._grace and self._intake.cancel_unattended(request_id):
                log.warning("nobody listens to this stream any more; cancelled",
                            extra={"request_id": request_id, "gateway": job.request.reply.gateway_id})

    async def _alive(self, gateways: set[str]) -> dict[str, bool]:
        names = sorted(gateways)
        values = await self._redis.mget([gateway_alive_key(self._settings, g) for g in names])
        return {g: v is not None for g, v in zip(names, values, strict=True)}

    async def _listened(self, orphans: list[Job]) -> set[str]:
        """The orphans some live gateway resumed."""
        if not orphans or self._streams is None:
            return set()
        found = await self._streams.listeners([j.request.request_id for j in orphans])
        listeners = [g or self._listener.get(j.request.request_id) for j, g in zip(orphans, found, strict=True)]
        for job, gateway in zip(orphans, listeners, strict=True):
            if gateway:
                self._listener[job.request.request_id] = gateway
        named = {g for g in listeners if g}
        alive = await self._alive(named) if named else {}
        return {j.request.request_id for j, g in zip(orphans, listeners, strict=True) if g and alive.get(g)}
