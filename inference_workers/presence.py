"""Stops generations nobody can receive: no client connection has been attached to their stream for its window.

A stream's connections come from the control topic (``listeners.py``): its accepting gateway's, each resume's, and
which of them detached (a client that dropped its connection). What the log cannot say is whether the gateway
process serving an attached connection still lives: a gateway process announces itself with a liveness key in
Redis (renewed with its reply-partition lease, see ``producers/relay/claim.py``). Every ``check_every_s`` the worker
looks up the gateways of the connections still attached to what it generates; a connection whose gateway is gone
counts as detached, having received what was emitted when its gateway was last seen. A stream with no connection
attached for its window (the detaching client's tier's resume window, or ``grace_s`` when its gateway died) is
cancelled and billed by the rule in ``listeners.py``. When Redis cannot be asked, no gateway is taken for dead on a
guess, but a stream every connection of which detached still has its window end.
A request that runs unattended (``ChatRequest.runs_unattended``: a background response, a non-streamed stored
answer) is never cancelled so: it is generated to its end.

Only gateway ids of the form ``instance/incarnation`` announce themselves (older gateways did not): others are
never taken for gone.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from redis.asyncio import Redis
from redis.exceptions import RedisError

from inference_workers.intake import Intake
from runtime.redis_client import gateway_alive_key
from runtime.settings import RedisSettings

log = logging.getLogger(__name__)


def announces_liveness(gateway_id: str) -> bool:
    return "/" in gateway_id


class GatewayPresence:
    def __init__(self, redis: Redis, settings: RedisSettings, intake: Intake, *, check_every_s: float,
                 grace_s: float, clock: Callable[[], float] | None = None) -> None:
        self._redis = redis
        self._settings = settings
        self._intake = intake
        self._every = check_every_s
        self._grace = grace_s
        self._clock = clock or intake.clock

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self._every)
            await self.check()

    async def check(self) -> None:
        # Generated to its end whoever listens (a background response, a non-streamed stored answer): its client
        # polls or reads the record later.
        jobs = [j for j in self._intake.jobs.values() if not j.request.runs_unattended]
        gateways = {g for j in jobs for g in j.listeners.attached_gateways() if announces_liveness(g)}
        try:
            alive: dict[str, bool] | None = await self._alive(gateways) if gateways else {}
        except (RedisError, OSError, TimeoutError):
            alive = None  # unknown is not gone: only the streams nobody is attached to are judged
        now = self._clock()
        for job in jobs:
            if alive is not None:
                job.listeners.seen(alive, job.tokens)
            self._intake.listeners_changed(job, now)
            request_id = job.request.request_id
            if job.listeners.expired(now, self._grace) and self._intake.cancel_unattended(request_id):
                log.warning("no client connection attached to this stream for its window; cancelled",
                            extra={"request_id": request_id, "gateway": job.request.reply.gateway_id})

    async def _alive(self, gateways: set[str]) -> dict[str, bool]:
        names = sorted(gateways)
        values = await self._redis.mget([gateway_alive_key(self._settings, g) for g in names])
        return {g: v is not None for g, v in zip(names, values, strict=True)}
