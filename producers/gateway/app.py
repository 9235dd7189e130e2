"""Builds the gateway's FastAPI app. Components are created once, in the lifespan, and kept on app.state.

Start-up order: the tenancy registry read to its end (orgs and keys), Cassandra and the tokenizer, the producer,
the reply-partition claim, the relay positioned at the end of that partition — only then does the gateway accept
requests.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from functools import partial

from fastapi import Depends, FastAPI

from billing.ledger import Ledger
from billing.prices import LivePrices, PriceLead, PriceStore
from producers.gateway import errors, openapi
from producers.gateway.admission import Admission
from producers.gateway.budget import HoldPricer
from producers.gateway.conversations import ConversationService
from producers.gateway.deps import GatewayContext, internal_only
from producers.gateway.limits import BodySizeLimit
from producers.gateway.local_limiter import LocalLimiter
from producers.gateway.pending_writes import PendingWrites
from producers.gateway.prompt import PromptBuilder
from producers.gateway.publisher import EventPublisher
from producers.gateway.refusals import RefusalReport
from producers.gateway.responses import ResponsesService
from producers.gateway.responses_protocol import ResponseView
from producers.gateway.routes import admin, chat, conversations, health, models, responses, stored, tokenize, usage
from producers.gateway.service import ChatService
from producers.gateway.stored import StoredCompletions
from producers.gateway.tokenization import Tokenization
from producers.gateway.turns import TurnPlanner
from producers.relay.claim import ReplyPartitionClaim
from producers.relay.demux import Relay
from producers.tenancy.admin import RegistryWriter, TenancyAdmin
from runtime import gc_pauses
from runtime.cassandra_client import connect_async
from runtime.dead_letters import DeadLetters
from runtime.kafka_clients import make_producer
from runtime.limiter import RateLimiter
from runtime.metrics import metrics_router
from runtime.redis_client import make_redis
from runtime.settings import Settings
from runtime.streams import StreamDirectory
from runtime.suspensions import KeySuspensions
from runtime.tenancy import TenancyView, work_queue
from schemas.topics import TOPICS
from stream_processors.store.completions import CompletionStore
from stream_processors.store.conversations import ConversationStore
from stream_processors.store.responses import ResponseStore

log = logging.getLogger(__name__)


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    settings: Settings = app.state.settings
    kafka = settings.kafka
    gc_pauses.watch()
    async with AsyncExitStack() as stack:
        cluster, session = await connect_async(settings.cassandra)
        stack.push_async_callback(asyncio.to_thread, cluster.shutdown)
        ledger = await Ledger.open(session, settings.cassandra.keyspace)
        prompts = await PromptBuilder.load(settings.model)

        producer = make_producer(kafka, role="gateway")
        await producer.start()
        stack.push_async_callback(producer.stop)

        tenancy = TenancyView(kafka, dead_letters=DeadLetters(producer, kafka, "gateway"),
                              catch_up_timeout_s=settings.tenancy.catch_up_timeout_s)
        stack.push_async_callback(tenancy.stop)
        await tenancy.start()
        tenancy_admin = TenancyAdmin(tenancy, RegistryWriter(kafka, tenancy), settings.tenancy.tiers.policies())

        redis = make_redis(settings.redis)
        stack.push_async_callback(redis.aclose)
        suspensions = await KeySuspensions.open(session, settings.cassandra.keyspace, redis, settings.redis)
        suspensions.start()
        stack.push_async_callback(suspensions.stop)
        token_topic = kafka.topic(TOPICS.tokens.name)
        partitions = await producer.partitions_for(token_topic)
        claim = ReplyPartitionClaim(redis, settings.redis, settings.gateway, token_topic)
        reply_partition = await claim.acquire(len(partitions))
        stack.push_async_callback(claim.close)

        # Refusals are counted here and reported in batches to the abuse detector (``refusals.py``).
        refusals = RefusalReport(producer, kafka, claim.gateway_id, every_s=settings.abuse.refusal_report_s)
        refusals.start()
        stack.push_async_callback(refusals.stop)

        relay = Relay(kafka, token_topic, reply_partition, DeadLetters(producer, kafka, "gateway"))
        await relay.start()
        stack.push_async_callback(relay.stop)

        # With the safety pre-filter on, requests go to it first; it forwards the admitted ones to the work queue of
        # their tier's priority class, where the gateway puts them itself when the pre-filter is off.
        tiers = settings.tenancy.tiers
        publisher = EventPublisher(
            producer, kafka,
            (lambda _: TOPICS.requests_submitted) if settings.safety.prefilter else
            partial(work_queue, tiers=tiers),
            TOPICS.control, claim.gateway_id, affinity=settings.gateway.conversation_affinity)
        tenancy_settings = settings.tenancy
        price_store = await asyncio.to_thread(PriceStore, session, settings.cassandra.keyspace,
                                              PriceLead(settings.processors.price_reload_s))
        holds = HoldPricer(LivePrices(price_store, await price_store.load()), settings.processors.price_reload_s)
        holds.start()
        stack.push_async_callback(holds.stop)
        admission = Admission(
            RateLimiter(redis, settings.redis, lease_s=tenancy_settings.lease_s,
                        reservation_ttl_s=tenancy_settings.reservation_ttl_s),
            LocalLimiter(share=tenancy_settings.local_share), tenancy_settings.tiers, holds, on_refused=refusals.note)
        stack.push_async_callback(admission.drain)
        streams = StreamDirectory(redis, settings.redis, ttl_s=settings.gateway.resume_ttl_s)
        conversation_store = await ConversationStore.open(session, settings.cassandra.keyspace)
        response_store = await ResponseStore.open(session, settings.cassandra.keyspace)
        pending = PendingWrites(redis, settings.redis, wait_s=settings.gateway.read_wait_s)
        turns = TurnPlanner(prompts, conversation_store, response_store, redis, settings.redis, settings.gateway,
                            in_flight=partial(_responding, streams), pending=pending)
        chat_service = ChatService(settings.gateway, prompts, publisher, relay, reply_partition, claim.gateway_id,
                                   admission=admission, tiers=tenancy_settings.tiers.policies(),
                                   streams=streams, turns=turns, pending=pending)
        stack.push_async_callback(chat_service.drain)
        # SIGTERM (``main.GatewayServer``): open streams are handed over at once, before the server drains.
        loop = asyncio.get_running_loop()
        app.state.on_exit = lambda: loop.call_soon_threadsafe(chat_service.hand_over)
        responses_service = ResponsesService(chat_service, prompts, turns, response_store, publisher, pending)
        stack.callback(responses_service.stop)
        stored_completions = StoredCompletions(await CompletionStore.open(session, settings.cassandra.keyspace),
                                               pending, forget_stream=chat_service.forget_stream)
        conversations_service = ConversationService(
            conversation_store, pending, admission=admission, tiers=tenancy_settings.tiers,
            item_max_chars=settings.gateway.conversation_item_max_chars)
        app.state.ctx = GatewayContext(settings, tenancy, tenancy_admin, suspensions, ledger, prompts, claim, relay,
                                       chat_service, stored_completions,
                                       responses_service,
                                       conversations_service, admission, Tokenization(prompts, admission))
        log.info("gateway ready", extra={"instance": settings.gateway.instance_id, "gateway_id": claim.gateway_id,
                                         "reply_partition": reply_partition})
        gc_pauses.freeze_startup()
        yield


async def _responding(streams: StreamDirectory, response_id: str, org_id: str) -> bool:
    """Whether a stored response of the org is being generated (its stream record lives)."""
    record = await streams.lookup(response_id)
    return (record is not None and record.org_id == org_id and bool(record.extra)
            and ResponseView.from_json(record.extra).store)


def create_app(settings: Settings) -> FastAPI:
    app = FastAPI(title="kns gateway", version="0.1.0", lifespan=lifespan)
    app.state.settings = settings
    errors.install(app)
    openapi.install(app)
    app.include_router(chat.router)
    app.include_router(stored.router)
    app.include_router(responses.router)
    app.include_router(conversations.router)
    app.include_router(models.router)
    app.include_router(usage.router)
    app.include_router(tokenize.router)
    # The admin API is not in the public /openapi.json (its own: /v1/admin/openapi.json, for admin keys); /metrics
    # only on the internal port (``routes/health.py``).
    app.include_router(admin.router, include_in_schema=False)
    app.include_router(health.router)
    app.include_router(metrics_router, dependencies=[Depends(internal_only)])
    app.add_middleware(BodySizeLimit, max_bytes=settings.gateway.max_body_bytes)
    return app
