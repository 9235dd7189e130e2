"""The gateway's use case, built for unit tests: a prompt builder that needs no tokenizer, a clock to move by hand."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from producers.gateway.admission import Admission
from producers.gateway.service import ChatService
from producers.relay.collector import StreamCollector
from runtime.settings import GatewaySettings, TierPolicy
from runtime.streams import StreamRecord
from schemas.events import ChatRequest, SamplingSpec
from tests.fakes.tenancy import local_admission


async def _three_tokens(messages: object) -> list[int]:
    return [1, 2, 3]


#: a PromptBuilder for model "m": every prompt is 3 tokens, every request asks for 8
PROMPTS = SimpleNamespace(card=SimpleNamespace(served_name="m"), render=lambda messages: [1, 2, 3],
                          tokens=_three_tokens, sampling=lambda body, n, **_: SamplingSpec(max_tokens=8))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def chat_service(publisher: Any, relay: Any, *, admission: Admission | None = None,
                 tiers: dict[str, TierPolicy] | None = None, **gateway: Any) -> ChatService:
    return ChatService(GatewaySettings(instance_id="gw", **gateway), PROMPTS, publisher, relay, 0,  # type: ignore[arg-type]
                       "gw/1", admission=admission or local_admission(), tiers=tiers)


@dataclass
class Sent:
    """One control event the gateway produced."""

    request_id: str
    delivered_tokens: int | None = None
    attachment: str | None = None
    window_s: float | None = None


@dataclass
class RecordingPublisher:
    """``producers/gateway/publisher.py``'s seam: what the gateway produced, in order, per kind."""

    submitted: list[ChatRequest] = field(default_factory=list)
    cancels: list[Sent] = field(default_factory=list)
    attaches: list[Sent] = field(default_factory=list)
    detaches: list[Sent] = field(default_factory=list)

    @property
    def cancelled(self) -> list[str]:
        return [c.request_id for c in self.cancels]

    async def submit(self, request: ChatRequest, traceparent: str) -> None:
        self.submitted.append(request)

    async def cancel(self, request_id: str, reason: str, traceparent: str | None = None,
                     delivered_tokens: int | None = None, attachment: str | None = None) -> None:
        self.cancels.append(Sent(request_id, delivered_tokens, attachment))

    async def attach(self, request_id: str, attachment: str, traceparent: str | None = None) -> None:
        self.attaches.append(Sent(request_id, attachment=attachment))

    async def detach(self, request_id: str, attachment: str, delivered_tokens: int, window_s: float, reason: str,
                     traceparent: str | None = None) -> None:
        self.detaches.append(Sent(request_id, delivered_tokens, attachment, window_s))


class Relay:
    """The relay's registration rule (``producers/relay/demux.py``): one connection per stream per gateway
    process; a second one is refused (ValueError, answered 409)."""

    def __init__(self) -> None:
        self.collectors: dict[str, StreamCollector] = {}

    def register(self, request_id: str) -> StreamCollector:
        self._refuse_second(request_id)
        collector = self.collectors[request_id] = StreamCollector(request_id)
        return collector

    async def resume(self, request_id: str, partition: int, from_offset: int, *, skip_through: int
                     ) -> StreamCollector:
        self._refuse_second(request_id)
        collector = self.collectors[request_id] = StreamCollector(request_id, skip_through=skip_through)
        return collector

    def unregister(self, request_id: str) -> None:
        self.collectors.pop(request_id, None)

    def _refuse_second(self, request_id: str) -> None:
        if request_id in self.collectors:
            raise ValueError(f"request {request_id} is already registered")


class Streams:
    """The stream registry over a dict: records by id, and the ids whose generation has ended (their claim is
    done)."""

    def __init__(self) -> None:
        self.records: dict[str, StreamRecord] = {}
        self.done: set[str] = set()

    async def record(self, record: StreamRecord) -> None:
        self.records[record.request_id] = record

    async def lookup(self, request_id: str) -> StreamRecord | None:
        return self.records.get(request_id)

    async def listen(self, request_id: str, gateway_id: str) -> None:
        pass

    async def finished(self, request_id: str) -> bool:
        return request_id in self.done
