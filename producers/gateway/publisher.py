"""Produces the gateway's events: chat requests (to the request topic); cancels, and the client connections that
attach to or detach from a stream (to the control topic).

One idempotent producer (``acks=all``) per gateway process. A request is keyed by its conversation id when
it has one, so the turns of a conversation land on one partition (one worker, a warm prefix cache).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError

from producers.gateway.errors import unavailable
from runtime.metrics import GATEWAY_CANCELS
from runtime.settings import KafkaSettings
from runtime.tracing import to_headers
from schemas.codec import codec_for
from schemas.events import ChatRequest, ControlAction, ControlEvent, utcnow
from schemas.headers import request_headers
from schemas.topics import TopicSpec


class EventPublisher:
    def __init__(self, producer: AIOKafkaProducer, kafka: KafkaSettings, route: Callable[[ChatRequest], TopicSpec],
                 control_topic: TopicSpec, gateway_id: str, *, affinity: bool = True) -> None:
        """``route``: the topic a request goes to (the safety pre-filter's, or its priority class's work queue);
        ``affinity``: key a conversation's turns by the conversation (else each request by its id)."""
        self._producer = producer
        self._kafka = kafka
        self._route = route
        self._control_topic = kafka.topic(control_topic.name)
        self._gateway_id = gateway_id
        self._affinity = affinity
        self._requests = codec_for(ChatRequest)
        self._controls = codec_for(ControlEvent)

    async def submit(self, request: ChatRequest, traceparent: str) -> None:
        """Produce the request and wait for the broker's ack: the request is durable when this returns."""
        try:
            await self._producer.send_and_wait(
                self._kafka.topic(self._route(request).name),
                value=self._requests.encode(request),
                key=(request.partition_key if self._affinity else request.request_id).encode(),
                # Readable without the schema: a worker that cannot decode the body can still answer the client.
                headers=[*to_headers(traceparent), *request_headers(request.request_id, request.reply.partition)],
                # Nearest, not truncated: the worker measures the hop from it (a floor read every hop 0.5 ms long).
                timestamp_ms=round(time.time() * 1000),
            )
        except KafkaError as exc:
            raise unavailable(f"The request queue is unavailable ({type(exc).__name__}); retry shortly.") from exc

    async def cancel(self, request_id: str, reason: str, traceparent: str | None = None,
                     delivered_tokens: int | None = None, attachment: str | None = None) -> None:
        """Tell the workers to stop generating a request. ``attachment``: the client connection this ends (None: an
        explicit cancel, by no connection), ``delivered_tokens`` what its client received."""
        await self._control(ControlEvent(request_id=request_id, action=ControlAction.CANCEL, reason=reason,
                                         issued_by=self._gateway_id, issued_at=utcnow(),
                                         delivered_tokens=delivered_tokens, attachment=attachment), traceparent)
        GATEWAY_CANCELS.inc()

    async def attach(self, request_id: str, attachment: str, traceparent: str | None = None) -> None:
        """A client connection of this gateway now receives the stream (a resume)."""
        await self._control(ControlEvent(request_id=request_id, action=ControlAction.ATTACH, reason="resumed",
                                         issued_by=self._gateway_id, issued_at=utcnow(), attachment=attachment),
                            traceparent)

    async def detach(self, request_id: str, attachment: str, delivered_tokens: int, window_s: float,
                     reason: str, traceparent: str | None = None) -> None:
        """A client connection went away having received ``delivered_tokens``; generation goes on for ``window_s``
        for a client to resume."""
        await self._control(ControlEvent(request_id=request_id, action=ControlAction.DETACH, reason=reason,
                                         issued_by=self._gateway_id, issued_at=utcnow(), attachment=attachment,
                                         delivered_tokens=delivered_tokens, window_s=window_s), traceparent)

    async def _control(self, event: ControlEvent, traceparent: str | None) -> None:
        await self._producer.send_and_wait(
            self._control_topic, value=self._controls.encode(event), key=event.request_id.encode(),
            headers=to_headers(traceparent) if traceparent else None,
        )
