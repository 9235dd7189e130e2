"""A request whose produce fails ambiguously at the gateway (an adversarial review's finding; failed before the fix)."""

from __future__ import annotations

import pytest
from aiokafka.errors import KafkaTimeoutError

from producers.gateway.errors import ApiError, unavailable
from producers.gateway.protocol import ChatCompletionRequest
from runtime.settings import TenancySettings
from schemas.events import ChatRequest
from tests.fakes.gateway import RecordingPublisher, chat_service
from tests.fakes.tenancy import api_key


class Relay:
    def __init__(self) -> None:
        self.registered: list[str] = []

    def register(self, request_id: str) -> object:
        self.registered.append(request_id)
        return object()

    def unregister(self, request_id: str) -> None:
        pass


class TimedOutPublisher(RecordingPublisher):
    """``send_and_wait`` timed out: the record may well be in the log (the broker appended it, the ack was lost;
    or the batch is still in the producer's accumulator and goes out after the error)."""

    async def submit(self, request: ChatRequest, traceparent: str) -> None:
        self.submitted.append(request)
        try:
            raise KafkaTimeoutError()
        except KafkaTimeoutError as exc:  # what EventPublisher.submit does (publisher.py:45-46)
            raise unavailable("The request queue is unavailable (KafkaTimeoutError); retry shortly.") from exc


async def test_a_request_whose_produce_timed_out_is_answered_503_with_its_cancel_already_under_way() -> None:
    """Promise 2 ('nothing billed for requests nobody received'). When ``submit`` raises (a KafkaTimeoutError
    during a broker restart or leader move), the first version unregistered the request and answered 503 - and
    produced no CANCEL. If the record did reach the log (ack lost / sent after the error), a worker generated the
    whole answer for nobody and billed it (its gateway is alive, so the presence check never fires); the client,
    told to retry, was billed a second time for its retry. The cancel is produced in the background (the client is
    not held up for it), started before the 503 is raised, so a handler cancelled once it answered cannot lose it."""
    publisher = TimedOutPublisher()
    chat = chat_service(publisher, Relay())
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], stream=True)
    with pytest.raises(ApiError) as raised:
        await chat.accept(body, api_key(), client_addr=None, traceparent="00-0-0-01")
    assert raised.value.status == 503
    assert chat._background or publisher.cancelled, "no cancel under way when the client is told 503"
    await chat.drain()
    (request,) = publisher.submitted
    assert publisher.cancelled == [request.request_id], "no CANCEL for a request that may be in the queue"


async def test_each_tier_gets_its_own_queue_deadline_and_the_gateway_waits_for_exactly_that() -> None:
    """Issue 9 item 5: a request carries its tier's queue deadline (the worker refuses it after that, unbilled), and
    the gateway's own patience for a first token is that deadline plus the grace, not a global timeout."""
    tiers = TenancySettings().tiers.policies()
    tiers["free"] = tiers["free"].model_copy(update={"queue_deadline_s": 5.0})
    chat = chat_service(RecordingPublisher(), Relay(), tiers=tiers, queue_deadline_s=60.0, first_token_grace_s=7.0)
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], stream=True)
    free = await chat.accept(body, api_key(tier="free"), client_addr=None, traceparent="00-0-0-01")
    plus = await chat.accept(body, api_key(tier="plus"), client_addr=None, traceparent="00-0-0-01")
    for accepted, deadline_s in ((free, 5.0), (plus, 60.0)):
        request = accepted.request
        assert request.deadline_at is not None
        assert (request.deadline_at - request.created_at).total_seconds() == deadline_s
        patience = chat._patience(accepted)
        assert deadline_s + 7.0 - 1.0 < patience <= deadline_s + 7.0
