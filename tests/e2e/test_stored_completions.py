"""Stored chat completions (issue 10): ``store: true`` through the official SDK, written by the store processor
from the log; retrieve, messages, list with metadata filters and cursors, delete; never another org's."""

from __future__ import annotations

import uuid

import httpx
import openai
import pytest

from tests.conftest import SESSION, Caller
from tests.e2e.conftest import MODEL, QUESTION
from tests.helpers import wait_for

pytestmark = pytest.mark.e2e


async def stored(client: openai.AsyncOpenAI, completion_id: str) -> object:
    """The stored completion, once the store processor has written it."""

    async def fetch() -> object:
        try:
            return await client.chat.completions.retrieve(completion_id)
        except openai.NotFoundError:
            return None

    return await wait_for(fetch, timeout_s=30, interval_s=0.3)


async def test_a_stored_completion_is_retrieved_listed_and_deleted(base_url: str, caller: Caller,
                                                                   make_caller) -> None:  # type: ignore[no-untyped-def]
    tag = uuid.uuid4().hex[:8]
    other = make_caller(org=f"org-stored-other-{SESSION}")
    async with openai.AsyncOpenAI(base_url=base_url, api_key=caller.secret, max_retries=0) as client, \
            openai.AsyncOpenAI(base_url=base_url, api_key=other.secret, max_retries=0) as stranger:
        answers = [await client.chat.completions.create(
            model=MODEL, messages=[{"role": "system", "content": "Be brief."}, *QUESTION], max_tokens=8,
            temperature=0, store=True, metadata={"tag": tag, "n": str(i)}) for i in range(3)]
        unstored = await client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4)
        first = answers[0]
        got = await stored(client, first.id)
        assert got.choices[0].message.content == first.choices[0].message.content  # type: ignore[attr-defined]
        assert got.usage == first.usage and got.model == MODEL  # type: ignore[attr-defined]
        for answer in answers[1:]:
            assert await stored(client, answer.id)

        messages = await client.chat.completions.messages.list(first.id)
        assert [(m.role, m.content) for m in messages.data] == [("system", "Be brief."),
                                                                ("user", QUESTION[0]["content"])]

        listed = await client.chat.completions.list(metadata={"tag": tag}, order="desc", limit=2)
        assert [c.id for c in listed.data] == [answers[2].id, answers[1].id] and listed.has_more
        rest = await client.chat.completions.list(metadata={"tag": tag}, order="desc", limit=2, after=answers[1].id)
        assert [c.id for c in rest.data] == [first.id] and not rest.has_more
        only = await client.chat.completions.list(metadata={"tag": tag, "n": "1"})
        assert [c.id for c in only.data] == [answers[1].id]

        with pytest.raises(openai.NotFoundError):
            await stranger.chat.completions.retrieve(first.id)
        with pytest.raises(openai.NotFoundError):
            await stranger.chat.completions.delete(first.id)
        assert (await stranger.chat.completions.list(metadata={"tag": tag})).data == []
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.retrieve(unstored.id)

        deleted = await client.chat.completions.delete(first.id)
        assert deleted.deleted and deleted.id == first.id
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.retrieve(first.id)
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.messages.list(first.id)
        assert [c.id for c in (await client.chat.completions.list(metadata={"tag": tag})).data] == [
            answers[1].id, answers[2].id]


async def test_bad_stored_completion_input_gets_a_clear_4xx(base_url: str, caller: Caller) -> None:
    auth = {"Authorization": f"Bearer {caller.secret}"}
    async with httpx.AsyncClient(base_url=base_url, headers=auth) as http:
        # each with the parameter it is refused for: a 400 for another reason must not pass
        cases = [
            ("metadata", await http.post("/chat/completions", json={
                "model": MODEL, "messages": QUESTION, "store": True, "metadata": {f"k{i}": "v" for i in range(17)}})),
            ("metadata", await http.post("/chat/completions", json={"model": MODEL, "messages": QUESTION,
                                                                    "metadata": {"k": "v" * 513}})),
            ("limit", await http.get("/chat/completions", params={"limit": 0})),
            ("order", await http.get("/chat/completions", params={"order": "sideways"})),
            ("after", await http.get("/chat/completions", params={"after": ""})),
            ("metadata", await http.get("/chat/completions", params={"metadata": "x"})),
        ]
        missing = [await http.delete("/chat/completions/chatcmpl-nope"),
                   await http.get("/chat/completions", params={"after": "chatcmpl-nope"})]
        allowed = (await http.request("OPTIONS", "/chat/completions")).headers.get("allow")
    for param, answer in cases:
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert set(error) >= {"message", "type", "param", "code"} and error["message"], answer.text
        assert (error["param"] or "").split(".")[0] == param, (param, error)
    for answer in missing:
        assert answer.status_code == 404 and answer.json()["error"]["code"] == "not_found", answer.text
    assert allowed == "GET, POST"
