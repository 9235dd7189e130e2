"""The chat-completion use case: validate, produce the request, then answer from the relay.

Order matters: the request is registered with the relay *before* it is produced (its first token could
otherwise arrive unrouted), and every exit path — finished, client gone, timeout, error — unregisters it.
A client that leaves before the final event gets a cancel event on the control topic, so the worker stops
generating for nobody.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from producers.gateway.errors import ApiError, bad_request, model_not_found
from producers.gateway.keys import ApiKey
from producers.gateway.prompt import PromptBuilder, to_event_messages
from producers.gateway.protocol import ChatCompletionRequest, usage_dict
from producers.gateway.publisher import EventPublisher
from producers.relay.collector import Delta, StreamCollector
from producers.relay.demux import Relay
from producers.relay.sse import DONE, ChunkFormatter, completion, error_event
from runtime.metrics import (
    GATEWAY_E2E,
    GATEWAY_IN_FLIGHT,
    GATEWAY_ITL,
    GATEWAY_REQUESTS,
    GATEWAY_TOKENS_OUT,
    GATEWAY_TTFT,
)
from runtime.settings import GatewaySettings
from schemas.events import ChatRequest, ReplyTo, TokenUsage, utcnow

log = logging.getLogger(__name__)

#: finish reasons a client may see; anything else from the engine is reported as "stop"
CLIENT_FINISH_REASONS = {"stop", "length", "content_filter"}


@dataclass
class Accepted:
    """A request that is in Kafka, with its stream buffer."""

    request: ChatRequest
    collector: StreamCollector
    traceparent: str
    include_usage: bool
    received_at: float
    created: int = field(default_factory=lambda: int(time.time()))
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished: bool = False

    @property
    def request_id(self) -> str:
        return self.request.request_id


class ChatService:
    def __init__(self, gateway: GatewaySettings, prompts: PromptBuilder, publisher: EventPublisher,
                 relay: Relay, reply_partition: int) -> None:
        self._settings = gateway
        self._prompts = prompts
        self._publisher = publisher
        self._relay = relay
        self._reply = ReplyTo(partition=reply_partition, gateway_id=gateway.instance_id)
        self._background: set[asyncio.Task[None]] = set()

    # --- 1. accept ------------------------------------------------------------------------------------

    async def accept(self, body: ChatCompletionRequest, key: ApiKey, *, client_addr: str | None,
                     traceparent: str) -> Accepted:
        received_at = time.perf_counter()
        if body.model != self._prompts.card.served_name:
            raise model_not_found(body.model)
        messages = to_event_messages(body)
        prompt_ids = await asyncio.to_thread(self._prompts.render, messages)
        sampling = self._prompts.sampling(body, len(prompt_ids))
        request = ChatRequest(
            request_id=f"chatcmpl-{uuid.uuid4().hex}",
            created_at=utcnow(),
            org_id=key.org_id,
            key_id=key.key_id,
            tier=key.tier,
            model=body.model,
            messages=messages,
            prompt_token_ids=prompt_ids,
            sampling=sampling,
            stream=body.stream,
            reply=self._reply,
            conversation_id=body.conversation_id,
            user=body.user,
            client_addr=client_addr,
        )
        collector = self._relay.register(request.request_id)
        try:
            await self._publisher.submit(request, traceparent)
        except BaseException:
            self._relay.unregister(request.request_id)
            raise
        GATEWAY_IN_FLIGHT.inc()
        log.info("request submitted", extra={"request_id": request.request_id, "prompt_tokens": len(prompt_ids),
                                             "max_tokens": sampling.max_tokens, "stream": body.stream})
        return Accepted(request, collector, traceparent, body.include_usage, received_at)

    # --- 2. answer ------------------------------------------------------------------------------------

    async def _next(self, accepted: Accepted) -> Delta:
        try:
            delta = await asyncio.wait_for(accepted.collector.get(), self._settings.stream_idle_timeout_s)
        except TimeoutError:
            return Delta(finish_reason="error",
                         error=f"no token arrived for {self._settings.stream_idle_timeout_s:.0f} s")
        if delta.token_count:
            now = time.perf_counter()
            if accepted.first_token_at is None:
                accepted.first_token_at = now
                GATEWAY_TTFT.observe(now - accepted.received_at)
            elif accepted.last_token_at is not None:
                GATEWAY_ITL.observe(now - accepted.last_token_at)
            accepted.last_token_at = now
            GATEWAY_TOKENS_OUT.inc(delta.token_count)
        if delta.finished:
            accepted.finished = True
        return delta

    async def stream(self, accepted: Accepted) -> AsyncIterator[bytes]:
        """SSE bytes for one request. Closing this iterator early (client gone) cancels the generation."""
        fmt = ChunkFormatter(accepted.request_id, accepted.request.model, accepted.created,
                             include_usage=accepted.include_usage)
        outcome = "cancelled"
        role_sent = False
        try:
            while True:
                delta = await self._next(accepted)
                if not role_sent:
                    # With the first output, as vLLM and OpenAI do: a chunk before any token would make clients
                    # (and benchmark tools) measure a time to first token that no token met.
                    yield fmt.role()
                    role_sent = True
                if delta.text:
                    yield fmt.content(delta.text)
                if not delta.finished:
                    continue
                if delta.error or delta.finish_reason not in CLIENT_FINISH_REASONS:
                    outcome = "error"
                    yield error_event(_generation_failed(delta).body())
                else:
                    outcome = delta.finish_reason or "stop"
                    yield fmt.finish(outcome)
                    if accepted.include_usage:
                        yield fmt.usage(_usage(accepted, delta.usage))
                yield DONE
                return
        finally:
            self._close(accepted, outcome, stream=True)

    async def complete(self, accepted: Accepted) -> dict[str, object]:
        """The whole answer as one ``chat.completion`` object."""
        parts: list[str] = []
        outcome = "cancelled"
        try:
            while True:
                delta = await self._next(accepted)
                parts.append(delta.text)
                if delta.finished:
                    break
            if delta.error or delta.finish_reason not in CLIENT_FINISH_REASONS:
                outcome = "error"
                raise _generation_failed(delta)
            text = "".join(parts)
            if delta.finish_reason == "content_filter" and not text:
                outcome = "content_filter"
                raise bad_request("The request was rejected by the content filter.", param="messages",
                                  code="content_filter")
            outcome = delta.finish_reason or "stop"
            return completion(accepted.request_id, accepted.request.model, accepted.created, text,
                              outcome, _usage(accepted, delta.usage))
        finally:
            self._close(accepted, outcome, stream=False)

    # --- 3. clean up ----------------------------------------------------------------------------------

    def _close(self, accepted: Accepted, outcome: str, *, stream: bool) -> None:
        self._relay.unregister(accepted.request_id)
        GATEWAY_IN_FLIGHT.dec()
        elapsed = time.perf_counter() - accepted.received_at
        GATEWAY_E2E.observe(elapsed)
        GATEWAY_REQUESTS.labels(outcome=outcome, stream=str(stream).lower()).inc()
        ttft = accepted.first_token_at - accepted.received_at if accepted.first_token_at else None
        log.info("request answered", extra={"request_id": accepted.request_id, "outcome": outcome,
                                            "ttft_ms": round(ttft * 1000, 1) if ttft else None,
                                            "e2e_ms": round(elapsed * 1000, 1)})
        if not accepted.finished:
            # The client is gone (or timed out): tell the worker. A task, because this frame is being cancelled.
            task = asyncio.create_task(self._cancel(accepted), name=f"cancel-{accepted.request_id}")
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _cancel(self, accepted: Accepted) -> None:
        try:
            await self._publisher.cancel(accepted.request_id, "client disconnected", accepted.traceparent)
            log.info("cancel produced", extra={"request_id": accepted.request_id})
        except Exception:
            log.exception("could not produce a cancel", extra={"request_id": accepted.request_id})

    async def drain(self) -> None:
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)


def _usage(accepted: Accepted, usage: TokenUsage | None) -> dict[str, object]:
    if usage is None:  # a final event always has usage; this only guards a malformed one
        return usage_dict(len(accepted.request.prompt_token_ids), 0, 0)
    return usage_dict(usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens)


def _generation_failed(delta: Delta) -> ApiError:
    return ApiError(502, f"The generation failed: {delta.error or delta.finish_reason}", type="server_error",
                    code="generation_failed")
