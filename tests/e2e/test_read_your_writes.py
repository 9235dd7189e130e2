"""Issue 36 item 2, read-your-writes: once a create returned (a response, streamed or not, a turn of a conversation,
a stored chat completion), every read of it on any gateway sees it, whatever the conversation writer's lag. Before,
`conversations.items.list` right after `responses.create(conversation=...)` returned listed 0 items (turn 1) and
2 of 4 (turn 2). With ``KNS_GATEWAY__READ_WAIT_S=0`` (no wait) these tests fail as they did."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.conftest import GATEWAY_PORT, Caller
from tests.e2e.conftest import MODEL, gateway_process
from tests.helpers import ServiceProcess

pytestmark = pytest.mark.e2e

READER_PORT = GATEWAY_PORT + 14


@pytest.fixture(scope="module")
def reader(gateway: ServiceProcess, service_env: dict[str, str]) -> Iterator[str]:
    """Another gateway, where the reads go."""
    proc = gateway_process(READER_PORT, service_env)
    proc.start()
    try:
        proc.wait_healthy(120)
        yield f"http://127.0.0.1:{READER_PORT}/v1"
    finally:
        proc.stop()


def sdk(base_url: str, caller: Caller) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url, api_key=caller.secret, max_retries=0, timeout=120)


def text_of(item: object) -> str:
    return "".join(part.text for part in item.content)  # type: ignore[attr-defined]


async def test_each_turn_is_listed_retrieved_and_its_response_read_on_another_gateway_as_its_create_returns(
        reader: str, base_url: str, caller: Caller) -> None:
    writer, other = sdk(base_url, caller), sdk(reader, caller)
    conversation = await writer.conversations.create()
    for turn in range(3):
        if turn == 1:  # streamed: "returned" is the end of its stream
            stream = await writer.responses.create(model=MODEL, conversation=conversation.id, stream=True,
                                                   input=f"Count to {turn + 2}.", max_output_tokens=8)
            # its end: completed, or incomplete when its 8 tokens were not enough (the turn is appended either way)
            ended = [e.response async for e in stream  # type: ignore[attr-defined]
                     if e.type in ("response.completed", "response.incomplete")]
            (response,) = ended
        else:
            response = await writer.responses.create(model=MODEL, conversation=conversation.id,
                                                     input=f"Count to {turn + 2}.", max_output_tokens=8)
        # At once, on another gateway: no wait, no retry
        listed = await other.conversations.items.list(conversation.id, order="asc")
        assert len(listed.data) == 2 * (turn + 1), f"turn {turn}: {len(listed.data)} items listed"
        answer = await other.conversations.items.retrieve(listed.data[-1].id, conversation_id=conversation.id)
        assert text_of(answer) == response.output_text
        retrieved = await other.responses.retrieve(response.id)
        assert (retrieved.status, retrieved.output_text) == (response.status, response.output_text)


async def test_a_stored_chat_completion_is_retrieved_on_another_gateway_as_its_create_returns(
        reader: str, base_url: str, caller: Caller) -> None:
    writer, other = sdk(base_url, caller), sdk(reader, caller)
    created = await writer.chat.completions.create(model=MODEL, max_tokens=8, store=True,
                                                   messages=[{"role": "user", "content": "Name a color."}])
    retrieved = await other.chat.completions.retrieve(created.id)
    assert retrieved.choices[0].message.content == created.choices[0].message.content
