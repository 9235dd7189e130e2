"""What a stream replays after its record is gone or was never kept (issue 37 L1): a deleted stored completion no
longer replays from the log; a ``store: false`` response is never readable by id (404, as OpenAI's) while its
stream stays resumable within the resume window, as a chat completion's is (``store: false`` by default): resuming
continues the delivery to the client that made it (a dropped connection is not a cancel), it keeps nothing longer."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.conftest import Caller
from tests.e2e.conftest import MODEL, QUESTION
from tests.helpers import wait_for

pytestmark = pytest.mark.e2e


def http_client(base_url: str, caller: Caller) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=base_url, headers={"authorization": f"Bearer {caller.secret}"}, timeout=60)


async def test_a_deleted_stored_completion_no_longer_replays_its_stream(base_url: str, caller: Caller) -> None:
    async with openai.AsyncOpenAI(base_url=base_url, api_key=caller.secret, max_retries=0) as client, \
            http_client(base_url, caller) as http:
        stream = await client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8, temperature=0,
                                                      store=True, stream=True)
        chunks = [chunk async for chunk in stream]  # to its end: the completion is stored once it ended
        completion_id = chunks[0].id

        async def stored() -> object | None:
            try:
                return await client.chat.completions.retrieve(completion_id)
            except openai.NotFoundError:
                return None

        await wait_for(stored, timeout_s=30, interval_s=0.3, what="the stored completion")
        replayed = await http.get(f"/chat/completions/{completion_id}", params={"stream": "true"})
        assert replayed.status_code == 200 and "data: [DONE]" in replayed.text, "replayed before its delete"

        assert (await client.chat.completions.delete(completion_id)).deleted
        after = await http.get(f"/chat/completions/{completion_id}", params={"stream": "true"})
        assert after.status_code == 404 and after.json()["error"]["code"] == "not_found", after.text
        resumed = await http.get(f"/chat/completions/{completion_id}", params={"stream": "true"},
                                 headers={"last-event-id": f"{completion_id}:0"})
        assert resumed.status_code == 404, resumed.text


async def test_a_store_false_response_is_unreadable_by_id_but_its_stream_resumes_within_the_window(
        base_url: str, caller: Caller) -> None:
    async with openai.AsyncOpenAI(base_url=base_url, api_key=caller.secret, max_retries=0) as client, \
            http_client(base_url, caller) as http:
        stream = await client.responses.create(model=MODEL, input="Count from one to five.", store=False,
                                               stream=True, max_output_tokens=8, temperature=0)
        events = [event async for event in stream]
        response_id = events[0].response.id  # type: ignore[union-attr]
        ended = events[-1].type  # response.completed, or response.incomplete at max_output_tokens

        for method in ("GET", "DELETE"):
            answer = await http.request(method, f"/responses/{response_id}")
            assert answer.status_code == 404, (method, answer.text)
        resumed = await http.get(f"/responses/{response_id}", params={"stream": "true", "starting_after": "0"})
        assert resumed.status_code == 200, resumed.text
        assert f"event: {ended}" in resumed.text and "event: response.created" not in resumed.text
