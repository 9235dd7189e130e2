"""The chat-completion use case: validate, produce the request, then answer from the relay.

Order matters: the request is registered with the relay *before* it is produced (its first token could
otherwise arrive unrouted), and every exit path — finished, client gone, timeout, error — unregisters it.
Whenever the stream ends without the worker's own final event (the client left, the gateway gave up waiting,
the stream turned out inconsistent), a cancel event goes to the control topic, so no worker generates (and
bills) for nobody.

Waiting: the request carries its queue deadline (``deadline_at``): a worker refuses it after that. The gateway
waits for the first token until a grace period after the deadline, then for each next token up to the idle
timeout.

Resuming: every stream has a record in Redis (``runtime/streams.py``); a client reconnecting to any gateway with
the last event id it received gets the rest, merged from the log. Each client connection to a stream is known to
the worker generating it (``inference_workers/listeners.py``): a resume *attaches* its connection, and a streamed
client whose connection drops is *detached* with what it received, not cancelled: the generation goes on for its
tier's resume window (``resume_window_s``), for the client to come back on any gateway. While the gateway stops,
its open streams are *handed over* the same way: their connections are closed without ``[DONE]`` and without a
cancel, and their clients resume elsewhere. Only an explicit cancel (:meth:`ChatService.cancel_stream`), a window
of 0, the gateway giving up, or an error stop a generation at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Coroutine, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from aiokafka.errors import KafkaError
from redis.exceptions import RedisError

from producers.gateway.admission import Admission, Ticket
from producers.gateway.early import EarlyRefusals
from producers.gateway.errors import (
    ApiError,
    bad_request,
    model_not_allowed,
    model_not_found,
    stream_not_found,
    unavailable,
)
from producers.gateway.pending_writes import PendingWrites
from producers.gateway.prompt import PromptBuilder, to_event_messages
from producers.gateway.protocol import ChatCompletionRequest, check_request_size, usage_dict
from producers.gateway.publisher import EventPublisher
from producers.gateway.structured import SchemaChecker
from producers.gateway.turns import TurnAsk, TurnPlanner
from producers.relay.collector import Delta, StreamCollector
from producers.relay.demux import Relay
from producers.relay.sse import DONE, ChunkFormatter, completion
from runtime.metrics import (
    GATEWAY_DROPPED,
    GATEWAY_E2E,
    GATEWAY_HANDOVERS,
    GATEWAY_IN_FLIGHT,
    GATEWAY_ITL,
    GATEWAY_REQUESTS,
    GATEWAY_RESUMES,
    GATEWAY_TOKENS_OUT,
    GATEWAY_TTFT,
)
from runtime.settings import GatewaySettings, TierPolicy, TierTable
from runtime.spend import BudgetHold
from runtime.streams import StreamDirectory, StreamRecord
from runtime.tenancy import ApiKey
from schemas.events import (
    ORIGIN_ATTACHMENT,
    ChatMessage,
    ChatRequest,
    ErrorCode,
    ReplyTo,
    SamplingSpec,
    TokenUsage,
    Turn,
    utcnow,
)

log = logging.getLogger(__name__)

#: why a connection detached when its client's network dropped it (not the gateway's hand-over)
DROPPED = "client connection dropped"
#: why a connection detached when its client came back on another connection of this gateway
SUPERSEDED = "the client reconnected on another connection"
#: finish reasons a client may see; anything else from the engine is reported as "stop"
CLIENT_FINISH_REASONS = {"stop", "length", "content_filter"}
#: Redis failures while recording or looking up a stream
STREAM_STORE_ERRORS = (RedisError, OSError, TimeoutError)


class HandedOver(Exception):
    """Raised out of a stream's response while the gateway stops: the server closes the connection without
    ``[DONE]``, which tells the client to reconnect (with ``Last-Event-ID``) to another gateway."""


@dataclass
class Accepted:
    """A request that is in Kafka (or a stream being resumed), with its stream buffer."""

    #: None for a resumed stream: another gateway accepted it
    request: ChatRequest | None
    collector: StreamCollector
    traceparent: str
    include_usage: bool
    received_at: float
    created: int = field(default_factory=lambda: int(time.time()))
    #: the request's queue deadline (its tier's); the gateway waits for a first token until its grace after it
    queue_deadline_s: float | None = None
    #: its admission (rate limits): the answer's x-ratelimit-* headers, its in-flight slots freed by ``_close``
    ticket: Ticket | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished: bool = False
    #: the finish reason of the final event that ended it (``finished``)
    final_reason: str | None = None
    #: prompt + completion tokens of the worker's final (what it billed)
    used_tokens: int | None = None
    model: str = ""
    #: a resumed stream: the position its client has (-1: nothing, not even the role chunk), and its request's
    #: queue deadline (Unix seconds, 0: unknown)
    client_has: int | None = None
    deadline_at: float = 0.0
    #: a background response: generated to its end whoever listens, cancelled only when asked to
    background: bool = False
    #: a resumed stream's record (what its accepting gateway promised the client)
    record: StreamRecord | None = None
    #: this client connection, as the worker knows it (``ControlEvent.attachment``)
    attachment: str = ORIGIN_ATTACHMENT
    #: how long the generation goes on for this client to come back if its connection drops (0: cancelled at once)
    resume_window_s: float = 0.0
    #: its client reconnected to this gateway before this connection was found dead: the stream is the new one's
    superseded: bool = False

    def __post_init__(self) -> None:
        if self.request is not None:
            self.model = self.request.model
            self.background = self.request.background

    @property
    def request_id(self) -> str:
        return self.request.request_id if self.request is not None else self.collector.request_id

    @property
    def resumed(self) -> bool:
        return self.client_has is not None

    def has(self, position: int) -> bool:
        """Whether a resumed stream's client already has the event at ``position``."""
        return self.client_has is not None and self.client_has >= position


class ChatService:
    def __init__(self, gateway: GatewaySettings, prompts: PromptBuilder, publisher: EventPublisher,
                 relay: Relay, reply_partition: int, gateway_id: str, *, admission: Admission,
                 tiers: Mapping[str, TierPolicy] | None = None, streams: StreamDirectory | None = None,
                 turns: TurnPlanner | None = None, pending: PendingWrites | None = None,
                 early: EarlyRefusals | None = None) -> None:
        self._settings = gateway
        self._admission = admission
        self._tiers = dict(tiers or {})
        self._prompts = prompts
        self._publisher = publisher
        self._relay = relay
        self._reply = ReplyTo(partition=reply_partition, gateway_id=gateway_id)
        self._streams = streams
        self._turns = turns
        self._pending = pending
        self._early = early or EarlyRefusals(TierTable.model_validate(dict(self._tiers)),
                                             on_refused=admission.note_refused)
        self._schemas = SchemaChecker()
        self._background: set[asyncio.Task[None]] = set()
        #: the streams being answered (handed over when the gateway stops)
        self._open: dict[str, Accepted] = {}
        self._handing_over = False

    def queue_deadline_s(self, tier: str) -> float:
        policy = self._tiers.get(tier)
        own = policy.queue_deadline_s if policy is not None else None
        return own if own is not None else self._settings.queue_deadline_s

    def resume_window_s(self, tier: str) -> float:
        policy = self._tiers.get(tier)
        own = policy.resume_window_s if policy is not None else None
        return own if own is not None else self._settings.resume_window_s

    # --- 1. accept ------------------------------------------------------------------------------------

    def check_model(self, model: str, key: ApiKey) -> None:
        if model != self._prompts.card.served_name:
            raise model_not_found(model)
        if not key.allows_model(model):
            raise model_not_allowed(model)

    def new_request(self, request_id: str, key: ApiKey, model: str, messages: list[ChatMessage],
                    prompt_ids: list[int], sampling: SamplingSpec, **fields: Any) -> ChatRequest:
        created_at = utcnow()
        return ChatRequest(request_id=request_id, created_at=created_at,
                           deadline_at=created_at + timedelta(seconds=self.queue_deadline_s(key.tier)),
                           org_id=key.org_id, key_id=key.key_id, tier=key.tier, model=model, messages=messages,
                           prompt_token_ids=prompt_ids, sampling=sampling, reply=self._reply, **fields)

    async def accept(self, body: ChatCompletionRequest, key: ApiKey, *, client_addr: str | None,
                     traceparent: str) -> Accepted:
        received_at = time.perf_counter()
        self.check_model(body.model, key)
        with self.preparing(key):  # a throttled key buys no rendering, no history read, no turn wait
            json_schema = await self.output_schema(body.output_schema)
            messages = to_event_messages(body)
            turn: Turn | None = None
            if body.conversation_id is not None:
                if self._turns is None:
                    raise unavailable("Conversations are not available on this gateway.")
                planned = await self._turns.plan(TurnAsk(
                    api="chat", org_id=key.org_id, new_input=messages, conversation_id=body.conversation_id,
                    max_output_tokens=body.requested_max_tokens, truncation="auto", param="conversation_id"))
                messages, prompt_ids, turn = planned.messages, planned.prompt_ids, planned.turn
            else:
                prompt_ids = await self._prompts.tokens(messages)
            sampling = self._prompts.sampling(body, len(prompt_ids), json_schema=json_schema)
            request = self.new_request(
                f"chatcmpl-{uuid.uuid4().hex}", key, body.model, messages, prompt_ids, sampling,
                stream=body.stream, conversation_id=body.conversation_id, user=body.user, client_addr=client_addr,
                store=bool(body.store), metadata=body.metadata or {}, turn=turn)
            accepted = await self.submit(request, key, traceparent=traceparent, received_at=received_at,
                                         include_usage=body.include_usage)
        if turn is not None and self._turns is not None:
            self._spawn(self._turns.started(request))
        return accepted

    async def output_schema(self, wanted: tuple[dict[str, Any], str, str | None] | None) -> str | None:
        """The checked JSON schema of a structured output (its schema, parameter and name), or a 400 naming it."""
        if wanted is None:
            return None
        schema, param, name = wanted
        return await self._schemas.check(schema, param=param, name=name)

    async def submit(self, request: ChatRequest, key: ApiKey, *, traceparent: str, received_at: float,
                     include_usage: bool = False, extra: str = "") -> Accepted:
        """Admit a built request (429 past its limits), produce it and record its stream: the request is in
        Kafka when this returns. ``extra``: what a resume needs besides the stream (a Responses stream's object)."""
        check_request_size(request, extra)  # a record Kafka and Redis keep: bounded before anything is admitted
        prompt_ids, sampling, created_at = request.prompt_token_ids, request.sampling, request.created_at
        # Reserves prompt + max_tokens against the key's and org's limits (429 past them) before anything is produced
        budget = self._admission.hold_for(key.org, request.model, len(prompt_ids), sampling.max_tokens, created_at)
        ticket = await self._admit(request.request_id, len(prompt_ids) + sampling.max_tokens, key, budget)
        created = int(time.time())
        try:
            collector = await self._submit(request, traceparent, created, include_usage, extra)
        except BaseException:
            self._spawn(self._admission.unsent(ticket, certain=False))
            raise
        accepted = Accepted(request, collector, traceparent, include_usage, received_at, created=created,
                            queue_deadline_s=self.queue_deadline_s(key.tier), ticket=ticket,
                            resume_window_s=self.resume_window_s(key.tier))
        if request.stream:
            self._track(accepted)
        return accepted

    def _track(self, accepted: Accepted) -> None:
        """An open stream, handed over if the gateway stops (at once if it is stopping already)."""
        self._open[accepted.request_id] = accepted
        if self._handing_over:
            accepted.collector.fail("the gateway is stopping", ErrorCode.GATEWAY_STOPPING)

    def preparing(self, key: ApiKey) -> AbstractContextManager[None]:
        """Around a request's work before its admission (``early.py``): refused at once when a refusal of its key's
        is remembered, or too many of its requests are being prepared here."""
        return self._early.preparing(key)

    def refuse_early(self, key: ApiKey) -> None:
        """Before even reading a request's body: a refusal of its key's remembered (``early.py``)."""
        self._early.check(key)

    async def _admit(self, request_id: str, tokens: int, key: ApiKey, budget: BudgetHold | None) -> Ticket:
        admitting = asyncio.ensure_future(self._admission.admit(request_id, tokens, key, budget))
        try:
            return await asyncio.shield(admitting)
        except ApiError as exc:
            self._early.remember(key, exc)  # its next requests are refused before any work, while it holds
            raise
        except asyncio.CancelledError:
            # The client left while Redis was deciding: a slot it was given must not stay taken until its lease ends
            self._spawn(self._give_back(admitting))
            raise

    async def _give_back(self, admitting: asyncio.Future[Ticket]) -> None:
        with contextlib.suppress(Exception):
            await self._admission.unsent(await admitting, certain=True)

    async def _submit(self, request: ChatRequest, traceparent: str, created: int, include_usage: bool,
                      extra: str) -> StreamCollector:
        collector = self._relay.register(request.request_id)
        try:
            # Both before the client sees a byte: the stream is resumable from its first event. One after the other:
            # written beside the produce, the stream record's Redis command went out first and held the request
            # 0.35 ms from the wire (DEVELOPERS.md "Benchmarks on 2 cores"); the first token is far off still.
            await self._publisher.submit(request, traceparent)
            await self._record_stream(request, collector, created, include_usage, extra)
        except BaseException:
            self._relay.unregister(request.request_id)
            # The produce may have failed after the record reached the log (a lost ack): no worker may generate it.
            self._spawn(self._cancel(request.request_id, "not accepted", traceparent, 0))
            raise
        GATEWAY_IN_FLIGHT.inc()
        log.info("request submitted", extra={"request_id": request.request_id,
                                             "prompt_tokens": len(request.prompt_token_ids),
                                             "max_tokens": request.sampling.max_tokens, "stream": request.stream})
        return collector

    async def _record_stream(self, request: ChatRequest, collector: StreamCollector, created: int,
                             include_usage: bool, extra: str) -> None:
        if self._streams is None:
            return
        record = StreamRecord(request.request_id, request.org_id, self._reply.partition, collector.from_offset,
                              request.model, created, include_usage, self._reply.gateway_id, request.user or "",
                              request.deadline_at.timestamp() if request.deadline_at else 0.0, extra,
                              store=_stores_row(request), conversation_id=request.conversation_id or "")
        try:
            await self._streams.record(record)
        except STREAM_STORE_ERRORS as exc:
            if request.background:
                # Its record is a background response's only handle while it runs (read, resume, cancel)
                raise unavailable("The stream registry is unavailable; retry the request.") from exc
            # The request is served all the same; only a resume elsewhere will not find it.
            log.warning("stream record not written; the stream cannot be resumed elsewhere",
                        extra={"request_id": record.request_id, "reason": repr(exc)})

    # --- 1b. resume -----------------------------------------------------------------------------------

    async def resume(self, request_id: str, client_has: int, key: ApiKey, *, traceparent: str,
                     responses: bool = False) -> Accepted:
        """The rest of a stream this or another gateway accepted, after the event at ``client_has`` (-1: all of
        it). 404 for an id that is unknown, expired or another org's, or of the other API (``responses``: a
        Responses API stream, else a chat completion's). A resume takes a read of its key's (issue 37 M2: it
        generates nothing, but each one reads the log again)."""
        received_at = time.perf_counter()
        await self._admission.admit_read(key)
        record = await self.stream_record(request_id)
        if record is None or not key.may_see(record.org_id, record.model) or bool(record.extra) != responses:
            GATEWAY_RESUMES.labels(outcome="not_found").inc()
            raise stream_not_found(request_id)
        # Its client may be back on this gateway before the old connection was found dead (a network that changed
        # address drops no FIN: TCP notices minutes later): the new connection takes the stream over.
        previous = self._supersede(request_id)
        try:
            collector, attachment = await self._attach(request_id, client_has, key, record, traceparent)
        finally:
            if previous is not None:
                # Now, not when the old task next runs (blocked writing to a dead socket, it may not for minutes,
                # while the worker counts it attached); after the new ATTACH, so that the worker never finds the
                # stream unattended in between (it would suspend the generation).
                self._spawn(self._detach(previous, SUPERSEDED))
        ticket = None
        if previous is not None:
            # Its generation goes on for this connection: so does its in-flight slot, freed when this one ends
            ticket, previous.ticket = previous.ticket, None
        GATEWAY_RESUMES.labels(outcome="resumed").inc()
        GATEWAY_IN_FLIGHT.inc()
        log.info("stream resumed", extra={"request_id": request_id, "client_has": client_has,
                                          "partition": record.partition, "accepted_by": record.gateway_id})
        accepted = Accepted(None, collector, traceparent, record.include_usage, received_at, created=record.created,
                            ticket=ticket, model=record.model, client_has=client_has, deadline_at=record.deadline_at,
                            record=record, attachment=attachment, resume_window_s=self.resume_window_s(key.tier))
        self._track(accepted)
        return accepted

    async def _attach(self, request_id: str, client_has: int, key: ApiKey, record: StreamRecord, traceparent: str
                      ) -> tuple[StreamCollector, str]:
        """Register a resumed stream with the relay and attach its new connection (the worker generates for it):
        the stream's collector and the connection's attachment id."""
        try:
            collector = await self._relay.resume(request_id, record.partition, record.from_offset,
                                                 skip_through=max(client_has, 0))
        except ValueError as exc:
            GATEWAY_RESUMES.labels(outcome="conflict").inc()
            raise ApiError(409, f"The stream '{request_id}' is being answered on another connection of this "
                                "gateway.", code="stream_in_use") from exc
        attachment = uuid.uuid4().hex[:12]
        try:
            assert self._streams is not None
            await self._streams.listen(request_id, self._reply.gateway_id)
            # Before the first byte: from here the worker keeps generating for this connection, window or not
            await self._publisher.attach(request_id, attachment, traceparent)
        except BaseException as exc:
            self._relay.unregister(request_id)
            # The ATTACH may have landed though its produce failed (a lost ack): its connection must not stay attached
            self._spawn(self._publish_detach(request_id, attachment, max(client_has, 0), self.resume_window_s(key.tier),
                                             "the resume failed", traceparent))
            if isinstance(exc, STREAM_STORE_ERRORS):
                raise unavailable("The stream registry is unavailable; retry the resume.") from exc
            if isinstance(exc, KafkaError):
                raise unavailable("The control topic is unavailable; retry the resume.") from exc
            raise
        return collector, attachment

    def _supersede(self, request_id: str) -> Accepted | None:
        """End the stream's old connection on this gateway, if it has one, as a hand-over (no ``[DONE]``, no cancel):
        the stream is the new connection's from now on, whenever the old one's task gets to close. The caller detaches
        the old connection and takes its admission over."""
        previous = self._open.pop(request_id, None)
        if previous is None:
            return None
        previous.superseded = True
        self._relay.unregister(request_id)
        previous.collector.fail(SUPERSEDED, ErrorCode.GATEWAY_STOPPING)
        return previous

    async def cancel_stream(self, request_id: str, key: ApiKey, *, traceparent: str, responses: bool = False) -> None:
        """Stop a generation on the client's word, from any gateway: honoured by its worker within one engine step,
        billed for what reached its clients (everything emitted while one is attached). 404 for an id that is
        unknown, expired or another org's (or of the other API); 409 for one that already ended."""
        record = await self.stream_record(request_id)
        if record is None or not key.may_see(record.org_id, record.model) or bool(record.extra) != responses:
            raise stream_not_found(request_id)
        try:
            assert self._streams is not None
            finished = await self._streams.finished(request_id)
        except STREAM_STORE_ERRORS as exc:
            raise unavailable("The stream registry is unavailable; retry the cancel.") from exc
        if finished:
            raise finished_already(request_id, responses=responses)
        try:
            await self._publisher.cancel(request_id, "cancelled by the client", traceparent)
        except KafkaError as exc:
            raise unavailable("The control topic is unavailable; retry the cancel.") from exc
        log.info("cancel requested", extra={"request_id": request_id})

    async def stream_record(self, request_id: str) -> StreamRecord | None:
        if self._streams is None:
            return None
        try:
            return await self._streams.lookup(request_id)
        except STREAM_STORE_ERRORS as exc:
            raise unavailable("The stream registry is unavailable; retry the resume.") from exc

    async def forget_stream(self, request_id: str) -> None:
        """No gateway resumes the stream any more (404 from now on)."""
        if self._streams is None:
            return
        try:
            await self._streams.forget(request_id)
        except STREAM_STORE_ERRORS as exc:
            raise unavailable("The stream registry is unavailable; retry.") from exc

    def hand_over(self) -> None:
        """The gateway is stopping: close every open stream for its client to resume elsewhere (the generations
        go on). Non-streaming requests are left to finish within the server's graceful shutdown."""
        self._handing_over = True
        for accepted in list(self._open.values()):
            accepted.collector.fail("the gateway is stopping", ErrorCode.GATEWAY_STOPPING)
        log.info("handing over open streams", extra={"streams": len(self._open)})

    # --- 2. answer ------------------------------------------------------------------------------------

    def _patience(self, accepted: Accepted) -> float:
        """How long to wait for the next delta: the first token until the deadline's grace, then the idle gap."""
        settings = self._settings
        if accepted.resumed:
            if accepted.collector.delivered:
                return settings.stream_idle_timeout_s
            # Resumed before its first token: it may still be queued, as long as its deadline allows.
            queued = (accepted.deadline_at - time.time() if accepted.deadline_at else settings.queue_deadline_s)
            return max(settings.stream_idle_timeout_s, queued + settings.first_token_grace_s)
        if accepted.first_token_at is None:
            deadline_s = accepted.queue_deadline_s or self._settings.queue_deadline_s
            return accepted.received_at + deadline_s + self._settings.first_token_grace_s - time.perf_counter()
        return self._settings.stream_idle_timeout_s

    async def next_delta(self, accepted: Accepted) -> Delta:
        """The stream's next news: its deltas merged since the last call, its end, or the gateway's timeout."""
        patience = self._patience(accepted)
        try:
            delta = await accepted.collector.get(max(patience, 0.0))
        except TimeoutError:
            # The gateway gives up on its own: accepted.finished stays false, so _close cancels the generation.
            waited = "a first token" if accepted.first_token_at is None else "the next token"
            # Positioned where the stream is, so that its error event comes after every delta the client has.
            return Delta(finish_reason="error", error=f"no worker produced {waited} within {patience:.0f} s",
                         error_code=ErrorCode.STREAM_TIMEOUT, position=accepted.collector.accepted)
        if delta.token_count:
            now = time.perf_counter()
            if accepted.first_token_at is None and not accepted.resumed:
                accepted.first_token_at = now
                GATEWAY_TTFT.observe(now - accepted.received_at)
            elif accepted.last_token_at is not None:
                GATEWAY_ITL.observe(now - accepted.last_token_at)
            accepted.last_token_at = now
            GATEWAY_TOKENS_OUT.inc(delta.token_count)
        if delta.from_worker:
            accepted.finished, accepted.final_reason = True, delta.finish_reason
            if delta.usage is not None:
                accepted.used_tokens = delta.usage.prompt_tokens + delta.usage.completion_tokens
            await self._note_pending_write(accepted, delta)
        return delta

    async def _note_pending_write(self, accepted: Accepted, delta: Delta) -> None:
        """Before its client sees the end: a read of what the writer stores for it waits for the row, on any
        gateway (read-your-writes)."""
        if self._pending is None:
            return
        request, record = accepted.request, accepted.record
        store = _stores_row(request) if request is not None else record is not None and record.store
        store = store and not _refused_unwritten(accepted, delta)
        conversation = (request.conversation_id if request is not None and request.turn is not None
                        else record.conversation_id if record is not None else None)
        if conversation and not _appended(delta.finish_reason or "", accepted.collector.delivered):
            conversation = None  # not appended: nothing to wait for
        if store or conversation:
            org_id = request.org_id if request is not None else record.org_id if record is not None else ""
            await self._pending.note(accepted.request_id, org_id, stored=store, conversation_id=conversation)

    async def stream(self, accepted: Accepted, *, event_ids: bool = True) -> AsyncIterator[bytes]:
        """SSE bytes for one request (``event_ids``: each event with its resume id). Closing this iterator early
        (client gone) cancels the generation; a gateway that stops hands the stream over instead
        (:class:`HandedOver`)."""
        fmt = ChunkFormatter(accepted.request_id, accepted.model, accepted.created,
                             include_usage=accepted.include_usage, event_ids=event_ids)
        outcome = "cancelled"
        role_sent = accepted.has(0)
        try:
            while True:
                delta = await self.next_delta(accepted)
                if delta.error_code == ErrorCode.GATEWAY_STOPPING:
                    # Stopping, or its relay feed failed: the generation goes on, the client resumes (here or
                    # on another gateway) from its last event.
                    outcome = "handed_over"
                    GATEWAY_HANDOVERS.inc()
                    raise HandedOver(accepted.request_id)
                if not role_sent:
                    # With the first output, as vLLM and OpenAI do: a chunk before any token would make clients
                    # (and benchmark tools) measure a time to first token that no token met.
                    yield fmt.role()
                    role_sent = True
                if delta.text:
                    yield fmt.content(delta.text, delta.position)
                if not delta.finished:
                    continue
                end = delta.position + 1  # the finish (or error) event's position; the usage chunk's is next
                if delta.error or delta.finish_reason not in CLIENT_FINISH_REASONS:
                    outcome = "error"
                    if not accepted.has(end):
                        yield fmt.frame(generation_failed(delta).body(), end)
                else:
                    outcome = delta.finish_reason or "stop"
                    if not accepted.has(end):
                        yield fmt.finish(outcome, end)
                    if accepted.include_usage and not accepted.has(end + 1):
                        yield fmt.usage(_usage(accepted, delta.usage), end + 1)
                yield DONE
                return
        finally:
            self.close(accepted, outcome, stream=True)

    async def complete(self, accepted: Accepted) -> dict[str, object]:
        """The whole answer as one ``chat.completion`` object."""
        parts: list[str] = []
        outcome = "cancelled"
        try:
            while True:
                delta = await self.next_delta(accepted)
                parts.append(delta.text)
                if delta.finished:
                    break
            if delta.error or delta.finish_reason not in CLIENT_FINISH_REASONS:
                outcome = "error"
                raise generation_failed(delta)
            text = "".join(parts)
            if delta.finish_reason == "content_filter" and not text:
                outcome = "content_filter"
                raise bad_request("The request was rejected by the content filter.", param="messages",
                                  code="content_filter")
            outcome = delta.finish_reason or "stop"
            return completion(accepted.request_id, accepted.model, accepted.created, text,
                              outcome, _usage(accepted, delta.usage))
        finally:
            self.close(accepted, outcome, stream=False)

    # --- 3. clean up ----------------------------------------------------------------------------------

    def detach(self, accepted: Accepted, *, stream: bool) -> Ticket | None:
        """A background response nobody relays here any more: its stream is closed on this gateway, the generation
        goes on, and its admission (in-flight slot) is handed to the caller, who ends it when the response ends."""
        ticket, accepted.ticket = accepted.ticket, None
        self.close(accepted, "detached", stream=stream)
        return ticket

    async def end_ticket(self, ticket: Ticket, used_tokens: int | None) -> None:
        await self._admission.end(ticket, used_tokens)

    def close(self, accepted: Accepted, outcome: str, *, stream: bool) -> None:
        """Every exit of a stream: unregister it, free its slots, and cancel a generation nobody will receive (or, for
        a streamed client whose connection dropped, leave it its window to come back)."""
        if outcome == "cancelled" and stream and not accepted.finished and accepted.resume_window_s > 0:
            outcome = "dropped"
        if not accepted.superseded:  # else the stream is a newer connection's already
            self._relay.unregister(accepted.request_id)
            self._open.pop(accepted.request_id, None)
        if accepted.ticket is not None:
            # Superseded and still holding its ticket: the resume that took it over failed, and the generation goes on
            # for the window all the same
            self._end_ticket(accepted, "dropped" if accepted.superseded else outcome)
        GATEWAY_IN_FLIGHT.dec()
        elapsed = time.perf_counter() - accepted.received_at
        GATEWAY_E2E.observe(elapsed)
        GATEWAY_REQUESTS.labels(outcome=outcome, stream=str(stream).lower()).inc()
        ttft = accepted.first_token_at - accepted.received_at if accepted.first_token_at else None
        log.info("request answered", extra={"request_id": accepted.request_id, "outcome": outcome,
                                            "ttft_ms": round(ttft * 1000, 1) if ttft else None,
                                            "e2e_ms": round(elapsed * 1000, 1)})
        if accepted.superseded:
            return  # detached when its client came back (``resume``); the stream and its end are the new connection's
        request = accepted.request
        dropped = outcome == "dropped"
        if (request is not None and request.conversation_id is not None and self._turns is not None
                and not _appended(outcome, accepted.collector.delivered)):
            self._spawn(self._turns.ended_unwritten(request.request_id, request.conversation_id))
        if accepted.background or outcome == "detached":
            # Generated to its end whoever listens: its client polls or resumes it later; only its explicit cancel
            # stops it.
            return
        if dropped or (outcome == "handed_over" and accepted.resume_window_s > 0):
            # The client's connection dropped, or this gateway is stopping: the generation goes on for the window,
            # for the client to resume on any gateway. A task, because this frame is being cancelled.
            why = DROPPED if dropped else "the gateway is stopping"
            self._spawn(self._detach(accepted, why))
            return
        if outcome == "handed_over":
            return  # a window of 0: the worker's own grace for a gateway gone applies
        if not accepted.finished or (outcome == "error" and accepted.final_reason != "cancelled"):
            # The client is gone (a window of 0, or not streamed), the gateway gave up, or the stream ended in error
            # (possibly before a worker even started it: a pre-filter's at-least-once refusal): no worker may go on
            # generating it. A stream its worker ended as cancelled needs no second cancel.
            reason = "the stream ended in error" if outcome == "error" else "client disconnected"
            self._spawn(self._cancel(accepted.request_id, reason, accepted.traceparent,
                                     accepted.collector.delivered, accepted.attachment))

    def _end_ticket(self, accepted: Accepted, outcome: str) -> None:
        """Free the request's in-flight slots, unless its generation goes on without this connection: a dropped
        stream waits out its window, a handed-over one goes on elsewhere, and its slot must bound the key's
        concurrency until then (else a key limited to one stream could drop and reopen as many as its RPM allows).
        The worker frees it when it settles the request; a slot of this process's own limiter (Redis down), which no
        worker can reach, when the window ends."""
        ticket = accepted.ticket
        assert ticket is not None
        if outcome not in ("dropped", "handed_over"):
            self._spawn(self._admission.end(ticket, accepted.used_tokens))
        elif ticket.local:
            later = accepted.resume_window_s if outcome == "dropped" else 0.0
            asyncio.get_running_loop().call_later(
                later, lambda: self._spawn(self._admission.end(ticket, accepted.used_tokens)))

    def spawn(self, coro: Coroutine[object, object, None]) -> None:
        """Run a clean-up to its end even though the request that started it is cancelled."""
        self._spawn(coro)

    def _spawn(self, coro: Coroutine[object, object, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _cancel(self, request_id: str, reason: str, traceparent: str | None, delivered: int,
                      attachment: str | None = None) -> None:
        try:
            await self._publisher.cancel(request_id, reason, traceparent, delivered, attachment)
            log.info("cancel produced", extra={"request_id": request_id, "reason": reason})
        except Exception:
            log.exception("could not produce a cancel", extra={"request_id": request_id})

    async def _detach(self, accepted: Accepted, reason: str) -> None:
        """The worker learns this connection is gone and what its client has; without it (Kafka away), the stream
        counts as attached until this gateway stops, then the worker's grace for a gateway gone applies."""
        if reason == DROPPED:
            GATEWAY_DROPPED.inc()  # the client's network, not this gateway's hand-over
        await self._publish_detach(accepted.request_id, accepted.attachment, accepted.collector.delivered,
                                   accepted.resume_window_s, reason, accepted.traceparent)

    async def _publish_detach(self, request_id: str, attachment: str, delivered: int, window_s: float, reason: str,
                              traceparent: str | None) -> None:
        try:
            await self._publisher.detach(request_id, attachment, delivered, window_s, reason, traceparent)
            log.info("client connection detached", extra={"request_id": request_id, "reason": reason,
                                                          "delivered_tokens": delivered, "window_s": window_s})
        except Exception:
            log.exception("could not produce a detach", extra={"request_id": request_id})

    async def drain(self) -> None:
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)


def _appended(outcome: str, delivered_tokens: int) -> bool:
    """Whether a turn that ended so is appended to its conversation (``stream_processors/store/turns.py``), or
    may still be (its generation goes on)."""
    return (outcome in ("stop", "length", "handed_over", "detached")
            or (outcome == "content_filter" and delivered_tokens > 0))


def _stores_row(request: ChatRequest) -> bool:
    """Whether the writer keeps a row of the request's outcome: a stored completion (chat completions' ``store``) or
    a stored response (a Responses API request carries its ``store`` in its turn, not in the request's)."""
    turn = request.turn
    if turn is not None and turn.api == "responses":
        return turn.store
    return request.store


def _refused_unwritten(accepted: Accepted, delta: Delta) -> bool:
    """A completion the safety pre-filter refused: no worker generated it (no prompt token billed, nothing
    delivered), and the pre-filter stores no completion for a refused prompt (``end_here(..., stored=False)``). A
    stored response's row is written however it ended (it says it was filtered), so its reads still wait for it."""
    responses = (accepted.request.turn is not None and accepted.request.turn.api == "responses"
                 if accepted.request is not None else accepted.record is not None and bool(accepted.record.extra))
    return (not responses and delta.finish_reason == "content_filter" and accepted.collector.delivered == 0
            and delta.usage is not None and delta.usage.prompt_tokens == 0)


def _usage(accepted: Accepted, usage: TokenUsage | None) -> dict[str, object]:
    if usage is None:  # a final event always has usage; this only guards a malformed one
        return usage_dict(len(accepted.request.prompt_token_ids) if accepted.request else 0, 0, 0)
    return usage_dict(usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens)


#: a stream that ended in error → (HTTP status, OpenAI error code); 502: the generation behind the gateway failed
STREAM_ERRORS: dict[str, tuple[int, str]] = {
    ErrorCode.QUEUE_DEADLINE_EXCEEDED: (503, "queue_deadline_exceeded"),
    ErrorCode.UNDECODABLE_REQUEST: (503, "service_unavailable"),
    ErrorCode.GATEWAY_STOPPING: (503, "service_unavailable"),
    ErrorCode.STREAM_TIMEOUT: (504, "timeout"),
}


def finished_already(request_id: str, *, responses: bool) -> ApiError:
    """A cancel of a generation that already ended (409: nothing changes)."""
    what, code = ("response", "response_finished") if responses else ("completion", "completion_finished")
    return ApiError(409, f"The {what} '{request_id}' has already ended; there is nothing to cancel.", code=code)


def generation_failed(delta: Delta) -> ApiError:
    if delta.finish_reason == "cancelled" and not delta.error_code:
        # A cancel its client sent (from any gateway), a halt-free stop: not a failure of ours
        return ApiError(409, "The completion was cancelled before it finished.", type="invalid_request_error",
                        code="cancelled")
    status, code = STREAM_ERRORS.get(delta.error_code or "", (502, delta.error_code or "generation_failed"))
    if delta.error_code == ErrorCode.QUEUE_DEADLINE_EXCEEDED:
        message = f"The service is overloaded: {delta.error}. Retry later."
    else:
        message = f"The generation failed: {delta.error or delta.finish_reason}"
    return ApiError(status, message, type="server_error", code=code)
