"""``GET /v1/responses/{id}/input_items`` (issue 39 item 6) over fakes: a stored response's new input, newest first by
default, paged both ways by an item's id; a response still being generated answers from its stream's record (its
view carries the input); another org's or an unknown response is 404, and so is a cursor that is none of its
items."""

from __future__ import annotations

from typing import Any

import pytest

from producers.gateway.errors import ApiError
from producers.gateway.responses import ResponsesService
from schemas.ids import input_item_id
from tests.fakes.conversations import Relay, Responses, Streams, planner, prompts, record, row, view
from tests.fakes.gateway import RecordingPublisher, chat_service
from tests.fakes.tenancy import api_key, local_admission

pytestmark = pytest.mark.unit
RESPONSE = "resp_" + "a" * 32
INPUTS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "one"},
          {"role": "assistant", "content": "two"}, {"role": "user", "content": "three"}]


def service(store: Responses, *records: Any) -> ResponsesService:
    publisher = RecordingPublisher()
    chat = chat_service(publisher, Relay(), admission=local_admission())
    chat._streams = Streams(*records)  # type: ignore[assignment]
    return ResponsesService(chat, prompts(), planner(), store, publisher)  # type: ignore[arg-type]


def stored() -> Responses:
    kept = row(RESPONSE, None)
    return Responses([type(kept)(**{**kept.__dict__, "input_items": INPUTS})])


def texts(page: dict[str, Any]) -> list[str]:
    return [item["content"][0]["text"] for item in page["data"]]


async def test_a_stored_responses_input_is_listed_newest_first_and_paged_both_ways() -> None:
    responses = service(stored())
    key = api_key(org_id="org")
    newest = await responses.input_items(RESPONSE, key, after=None, limit=20, ascending=False)
    assert texts(newest) == ["three", "two", "one", "Be brief."] and not newest["has_more"]
    assert [item["id"] for item in newest["data"]] == [input_item_id(RESPONSE, i) for i in (3, 2, 1, 0)]
    assert [item["role"] for item in newest["data"]] == ["user", "assistant", "user", "system"]
    assert newest["data"][1]["content"][0]["type"] == "output_text"  # an assistant's text, as OpenAI's
    first = await responses.input_items(RESPONSE, key, after=None, limit=2, ascending=True)
    assert texts(first) == ["Be brief.", "one"] and first["has_more"] and first["last_id"] == first["data"][1]["id"]
    rest = await responses.input_items(RESPONSE, key, after=first["last_id"], limit=2, ascending=True)
    assert texts(rest) == ["two", "three"] and not rest["has_more"]


async def test_a_response_still_generating_lists_the_input_its_stream_record_carries() -> None:
    running = view(id=RESPONSE, input_items=INPUTS[1:2])
    responses = service(Responses(), record(running))
    page = await responses.input_items(RESPONSE, api_key(org_id="org"), after=None, limit=20, ascending=True)
    assert texts(page) == ["one"]


async def test_another_orgs_or_an_unknown_response_and_a_foreign_cursor_are_404() -> None:
    responses = service(stored(), record(view(id="resp_" + "b" * 32, input_items=INPUTS), org_id="org"))
    with pytest.raises(ApiError) as info:
        await responses.input_items(RESPONSE, api_key(org_id="another-org"), after=None, limit=20, ascending=True)
    assert info.value.status == 404
    with pytest.raises(ApiError) as info:
        await responses.input_items("resp_" + "c" * 32, api_key(org_id="org"), after=None, limit=20, ascending=True)
    assert info.value.status == 404
    with pytest.raises(ApiError) as info:
        await responses.input_items(RESPONSE, api_key(org_id="org"), after=input_item_id("resp_other", 0), limit=20,
                                    ascending=True)
    assert (info.value.status, info.value.param) == (404, "after")
