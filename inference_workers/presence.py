"""Stops generations nobody can receive: their gateway process is gone.

A gateway process announces itself with a liveness key in Redis (renewed with its reply-partition lease, see
``producers/relay/claim.py``); each request names the gateway process that waits for it
(``ReplyTo.gateway_id``). Every few seconds the worker looks up the gateways of what it is generating; a
gateway whose key has been missing for ``grace_s`` is gone, and its requests are cancelled (billed for what
was generated, as a client that hangs up). When Redis cannot be asked, nothing is cancelled on a guess.

Only gateway ids of the form ``instance/incarnation`` announce themselves (older gateways did not): others are
never taken for gone.
"""

from __future__ import annotations

import asyncio
import logging
import time

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
                 grace_s: float) -> None:
        self._redis = redis
        self._settings = settings
        self._intake = intake
        self._every = check_every_s
        self._grace = grace_s
        self._missing_since: dict[str, float] = {}

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self._every)
            await self.check()

    async def check(self) -> None:
        gateways = sorted({j.request.reply.gateway_id for j in self._intake.jobs.values()
                           if announces_liveness(j.request.reply.gateway_id)})
        self._missing_since = {g: t for g, t in self._missing_since.items() if g in gateways}
        if not gateways:
            return
        try:
            alive = await self._redis.mget([gateway_alive_key(self._settings, g) for g in gateways])
        except (RedisError, OSError, TimeoutError):
            return  # unknown is not gone
        now = time.monotonic()
        for gateway, value in zip(gateways, alive, strict=True):
            if value is not None:
                self._missing_since.pop(gateway, None)
                self._intake.attended(gateway)
                continue
            since = self._missing_since.setdefault(gateway, now)
            if now - since >= self._grace:
                cancelled = self._intake.cancel_unattended(gateway)
                log.warning("gateway gone; its streams are cancelled", extra={"gateway": gateway,
                                                                            "requests": cancelled})
