"""Issue 37 H2: the record a request leaves in Kafka and Redis is bounded before anything is admitted or produced."""

from __future__ import annotations

import pytest

from producers.gateway.errors import ApiError
from producers.gateway.protocol import MAX_REQUEST_EVENT_BYTES, ChatCompletionRequest
from tests.fakes.gateway import RecordingPublisher, chat_service
from tests.fakes.tenancy import api_key


class Relay:
    def register(self, request_id: str) -> object:
        raise AssertionError("nothing may be registered for a request too large to accept")

    def unregister(self, request_id: str) -> None:
        pass


async def test_a_request_whose_record_would_be_too_large_is_refused_before_admission_and_produce() -> None:
    publisher = RecordingPublisher()
    chat = chat_service(publisher, Relay())
    body = ChatCompletionRequest.model_validate({"model": "m", "stream": True, "messages": [
        {"role": "user", "content": "x" * (MAX_REQUEST_EVENT_BYTES + 1)}]})
    with pytest.raises(ApiError) as refused:
        await chat.accept(body, api_key(), client_addr=None, traceparent="00-0-0-01")
    assert (refused.value.status, refused.value.code) == (400, "request_too_large")
    assert publisher.submitted == [] and publisher.cancels == []
    await chat.drain()
