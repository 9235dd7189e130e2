"""Builds the gateway's FastAPI app. Components are created once, in the lifespan, and kept on app.state.

Start-up order: Cassandra (API keys) and the tokenizer, the producer, the reply-partition claim, the relay
positioned at the end of that partition — only then does the gateway accept requests.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

from fastapi import FastAPI

from billing.ledger import Ledger
from producers.gateway import errors
from producers.gateway.deps import GatewayContext
from producers.gateway.keys import ApiKeyRegistry, KeySuspensions
from producers.gateway.limits import BodySizeLimit
from producers.gateway.prompt import PromptBuilder
from producers.gateway.publisher import EventPublisher
from producers.gateway.routes import chat, health, models, usage
from producers.gateway.service import ChatService
from producers.relay.claim import ReplyPartitionClaim
from producers.relay.demux import Relay
from runtime.cassandra_client import connect_async
from runtime.kafka_clients import make_producer
from runtime.metrics import metrics_router
from runtime.redis_client import make_redis
from runtime.settings import Settings
from schemas.topics import TOPICS

log = logging.getLogger(__name__)


def _exit_on(event: asyncio.Event, reason: str) -> asyncio.Task[None]:
    """A gateway that lost its reply partition must not serve: stop the server (a supervisor restarts it)."""

    async def watch() -> None:
        await event.wait()
        log.critical("stopping the gateway", extra={"reason": reason})
        os.kill(os.getpid(), signal.SIGTERM)

    return asyncio.create_task(watch(), name="fatal-watch")


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    settings: Settings = app.state.settings
    kafka = settings.kafka
    async with AsyncExitStack() as stack:
        cluster, session = await connect_async(settings.cassandra)
        stack.push_async_callback(asyncio.to_thread, cluster.shutdown)
        keys = await ApiKeyRegistry.open(session, settings.cassandra.keyspace,
                                         cache_ttl_s=settings.gateway.api_key_cache_ttl_s)
        ledger = await Ledger.open(session, settings.cassandra.keyspace)
        prompts = await PromptBuilder.load(settings.model)

        producer = make_producer(kafka, role="gateway")
        await producer.start()
        stack.push_async_callback(producer.stop)

        redis = make_redis(settings.redis)
        stack.push_async_callback(redis.aclose)
        suspensions = await KeySuspensions.open(session, settings.cassandra.keyspace, redis, settings.redis)
        token_topic = kafka.topic(TOPICS.tokens.name)
        partitions = await producer.partitions_for(token_topic)
        claim = ReplyPartitionClaim(redis, settings.redis, settings.gateway, token_topic)
        reply_partition = await claim.acquire(len(partitions))
        stack.push_async_callback(claim.close)

        relay = Relay(kafka, token_topic, reply_partition)
        await relay.start()
        stack.push_async_callback(relay.stop)

        # With the safety pre-filter on, requests go to it first; it forwards the admitted ones to the workers.
        request_topic = TOPICS.requests_submitted if settings.safety.prefilter else TOPICS.requests_admitted
        publisher = EventPublisher(producer, kafka, request_topic, TOPICS.control, settings.gateway.instance_id)
        chat_service = ChatService(settings.gateway, prompts, publisher, relay, reply_partition)
        stack.push_async_callback(chat_service.drain)
        app.state.ctx = GatewayContext(settings, keys, suspensions, ledger, prompts, claim, relay, chat_service)
        watcher = _exit_on(claim.lost, "reply partition lease lost")
        log.info("gateway ready", extra={"instance": settings.gateway.instance_id,
                                         "reply_partition": reply_partition})
        try:
            yield
        finally:
            watcher.cancel()


def create_app(settings: Settings) -> FastAPI:
    app = FastAPI(title="kns gateway", version="0.1.0", lifespan=lifespan)
    app.state.settings = settings
    errors.install(app)
    app.include_router(chat.router)
    app.include_router(models.router)
    app.include_router(usage.router)
    app.include_router(health.router)
    app.include_router(metrics_router)
    app.add_middleware(BodySizeLimit, max_bytes=settings.gateway.max_body_bytes)
    return app
