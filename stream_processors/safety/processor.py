"""The safety processor: a pre-filter on requests and a post-filter on token streams, one classifier.

Pre-filter (``llm.requests.submitted.v1`` → ``llm.requests.admitted.v1``): every request is classified before any
GPU work, the whole of what reaches the model: every message of every role, in windows (``screening.py``).
Admitted ones are forwarded unchanged (headers included); refused ones get a final token event with
``content_filter`` on their reply partition, so the client's stream ends at once. Every decision is a verdict event.

Post-filter (``llm.tokens.emitted.v1``, beside the relays, not in their path): each request's latest output is
classified every ``post_stride_tokens`` tokens and at its end; a harmful window produces a HALT on the control
topic, the worker aborts the request and its final event says ``content_filter``.

Guarantee: at-least-once. Exactly-once would make the pre-filter's forwarded requests visible to workers only when
a Faust transaction commits (every commit interval), adding that much to every time-to-first-token. A duplicate
forward is harmless (workers generate a request id once), so is a duplicate halt (aborting twice is a no-op).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections import OrderedDict
from typing import Any

import faust
from redis.exceptions import RedisError

from runtime.limiter import RateLimiter
from runtime.metrics import SAFETY_PREFILTER_DELAY, SAFETY_STALE
from runtime.redis_client import key as redis_key
from runtime.redis_client import make_redis
from runtime.settings import Settings
from runtime.tenancy import work_queue
from schemas.codec import codec_for
from schemas.events import (
    ChatRequest,
    ControlEvent,
    SafetyStage,
    SafetyVerdict,
    StoredCompletion,
    TokenEvent,
    utcnow,
)
from schemas.headers import reply_address
from schemas.topics import TOPICS
from stream_processors.app import DeadLetters, build_app, raw_topic
from stream_processors.safety.classifier import SafetyClassifier, Verdict, make_classifier
from stream_processors.safety.policy import (
    PREFILTER,
    OutputWindow,
    expired,
    halt,
    refusal,
    unreadable,
    verdict_event,
)
from stream_processors.safety.screening import PromptScreen, classify_many, counted

log = logging.getLogger(__name__)


async def classify(classifier: SafetyClassifier, text: str, stage: str) -> Verdict:
    (verdict,) = counted(stage, await classify_many(classifier, [text], stage))
    return verdict


class OpenOutputs:
    """Post-filter state per request id, bounded (oldest dropped first)."""

    def __init__(self, stride: int, window_chars: int, capacity: int = 50_000) -> None:
        self._windows: OrderedDict[str, OutputWindow] = OrderedDict()
        self._stride, self._chars, self._capacity = stride, window_chars, capacity

    def get(self, request_id: str) -> OutputWindow:
        window = self._windows.get(request_id)
        if window is None:
            window = self._windows[request_id] = OutputWindow(self._stride, self._chars)
            if len(self._windows) > self._capacity:
                self._windows.popitem(last=False)
        return window

    def close(self, request_id: str) -> None:
        self._windows.pop(request_id, None)


def build(settings: Settings) -> faust.App:
    # A new group starts from the beginning (no request submitted before it started is lost); what is too old
    # to matter is skipped by age.
    app = build_app(settings, "safety", guarantee="at_least_once")
    classifier = make_classifier(settings.safety)
    prompts = PromptScreen(classifier)
    redis = make_redis(settings.redis)
    dead = DeadLetters(app, settings, "safety")
    tokens = raw_topic(app, settings, TOPICS.tokens)
    work_queues = {spec.name: raw_topic(app, settings, spec) for spec in TOPICS.work_queues()}
    tiers = settings.tenancy.tiers
    verdicts, control = raw_topic(app, settings, TOPICS.verdicts), raw_topic(app, settings, TOPICS.control)
    records, record_codec = raw_topic(app, settings, TOPICS.stored_completions), codec_for(StoredCompletion)
    requests_codec, token_codec = codec_for(ChatRequest), codec_for(TokenEvent)
    # Refusals are written in the workers' token record version: gateways not upgraded yet read them too.
    encode_token = functools.partial(token_codec.encode, version=settings.worker.token_record_version)
    verdict_codec, control_codec = codec_for(SafetyVerdict), codec_for(ControlEvent)
    outputs = OpenOutputs(settings.safety.post_stride_tokens, settings.safety.post_window_chars)
    limiter = RateLimiter(redis, settings.redis)

    async def unbilled(request_id: str) -> None:
        """A request answered here is never generated: its reserved tokens and budget hold are given back."""
        try:
            await limiter.settle(request_id, 0, billed=False)
        except (RedisError, OSError) as exc:  # they lapse with the reservation's TTL
            log.warning("could not settle a refused request", extra={"request_id": request_id, "error": repr(exc)})

    async def end_here(request: ChatRequest, final: TokenEvent, *, stored: bool = True) -> None:
        """Answer a request that is never generated: its final event, and its record when it keeps one (a stored
        completion, a turn: its response row says how it ended instead of staying unknown). ``stored=False``: not
        among the org's stored completions whatever its ``store`` (a refused prompt is not stored), a turn is still
        recorded."""
        await tokens.send(key=request.request_id.encode(), value=encode_token(final),
                          partition=request.reply.partition)
        record = StoredCompletion.of(request, "", final)
        if not stored:
            record = record.model_copy(update={"listed": False})
        if record.listed or record.turn is not None:
            await records.send(key=request.request_id.encode(), value=record_codec.encode(record))
        await unbilled(request.request_id)

    async def send_verdict(event: SafetyVerdict) -> None:
        await verdicts.send(key=event.request_id.encode(), value=verdict_codec.encode(event))

    async def answer_unreadable(event: Any) -> None:
        address = reply_address(event.message.headers)
        if address is not None:
            request_id, partition = address
            await tokens.send(key=request_id.encode(), partition=partition,
                              value=encode_token(unreadable(request_id, "unknown schema")))

    async def screen(events: list[Any]) -> None:
        """Classify a batch of submitted requests; forward the admitted, refuse the others."""
        batch = []
        now = utcnow()
        for event in events:
            request = await dead.decode(requests_codec, event)
            if request is None:
                await answer_unreadable(event)
                continue
            ended = expired(request, now)
            if ended is not None:  # its client is told at once; nothing is generated or billed
                SAFETY_STALE.labels(stage="pre").inc()
                await end_here(request, ended)
                continue
            if request.deadline_at is None and now.timestamp() - request.created_at.timestamp() > \
                    settings.safety.max_request_age_s:  # an older gateway's request (no deadline): dropped
                SAFETY_STALE.labels(stage="pre").inc()
                continue
            batch.append((event, request))
        if not batch:
            return
        verdicts = await prompts.verdicts([request for _, request in batch])
        for (event, request), verdict in zip(batch, verdicts, strict=True):
            if verdict.blocked:
                await end_here(request, refusal(request), stored=False)
            else:
                await work_queues[work_queue(request, tiers).name].send(
                    key=event.key, value=event.value, headers=event.message.headers)
            SAFETY_PREFILTER_DELAY.observe(max(0.0, time.time() - event.message.timestamp))
            await send_verdict(verdict_event(request.request_id, SafetyStage.PRE, verdict, classifier.name,
                                             org_id=request.org_id, key_id=request.key_id))

    @app.agent(raw_topic(app, settings, TOPICS.requests_submitted))
    async def prefilter(stream: Any) -> None:
        # Whatever queued up meanwhile, up to a batch, waiting at most a few milliseconds for company.
        async for events in stream.take_events(settings.safety.prefilter_batch, within=0.005):
            await screen(events)

    @app.agent(raw_topic(app, settings, TOPICS.tokens))
    async def postfilter(stream: Any) -> None:
        async for event in stream.events():
            record = await dead.decode(token_codec, event)
            if record is None or record.worker_id == PREFILTER:
                continue
            for token in record.split():  # one record per engine step: several requests' deltas
                await screen_output(token)

    async def screen_output(token: TokenEvent) -> None:
        if time.time() - token.emitted_at_us / 1e6 > settings.safety.post_max_age_s:
            SAFETY_STALE.labels(stage="post").inc()
            return
        window = outputs.get(token.request_id)
        due = not window.halted and window.add(token)
        if token.is_final:
            outputs.close(token.request_id)
        if not due:
            return
        verdict = await classify(classifier, window.text, "post")
        if not verdict.blocked:
            return
        window.halted = True
        if not token.is_final:  # a harmful last window is only recorded: nothing is left to stop
            halt_event = halt(token.request_id, verdict)
            await control.send(key=token.request_id.encode(), value=control_codec.encode(halt_event))
        owner: list[str | None] = [None, None]
        with contextlib.suppress(RedisError, OSError, TimeoutError):  # attribution only: never stop for it
            owner = await redis.hmget(  # type: ignore[assignment]
                redis_key(settings.redis, "request", token.request_id), ["org", "key"])
        await send_verdict(verdict_event(token.request_id, SafetyStage.POST, verdict, classifier.name,
                                         org_id=owner[0], key_id=owner[1], at_token=window.tokens))
        log.info("stream halted", extra={"request_id": token.request_id, "category": verdict.category,
                                         "at_token": window.tokens})

    return app
