"""Resuming a chat completion's stream from a position (``GET /v1/chat/completions/{id}?stream=true`` with
``starting_after=<position>`` or ``Last-Event-ID``, what a browser's EventSource can send; or the ``POST`` with
``Last-Event-ID``, what an SDK retrying sends) gives exactly the events after it, and a resume is not a new request:
a key whose requests per minute are spent still resumes its streams."""

from __future__ import annotations

import httpx
import orjson
import pytest

from producers.tenancy.admin import Limits
from tests.conftest import GATEWAY_PORT, SESSION, Caller
from tests.e2e.test_resume import BODY, events
from tests.helpers import ServiceProcess

pytestmark = pytest.mark.e2e

URL = f"http://127.0.0.1:{GATEWAY_PORT}/v1/chat/completions"
SHORT = {**BODY, "max_tokens": 16}
#: one server-sent event: its id (``<completion id>:<position>``) and the text it carries
Event = tuple[str, str]


def auth(caller: Caller) -> dict[str, str]:
    return {"Authorization": f"Bearer {caller.secret}"}


def position(event: Event) -> int:
    return int(event[0].rpartition(":")[2])


async def read_all(response: httpx.Response) -> list[Event]:
    """Every event of the stream up to ``[DONE]`` (which must come), each with its id and text."""
    assert response.status_code == 200, (await response.aread()).decode()
    got = []
    async for event_id, data in events(response):
        if data == "[DONE]":
            return got
        body = orjson.loads(data)
        assert event_id is not None and "error" not in body, data
        got.append((event_id, "".join(c["delta"].get("content") or "" for c in body.get("choices", ()))))
    raise AssertionError(f"the stream ended without [DONE] after {len(got)} events")


async def streamed(http: httpx.AsyncClient, caller: Caller) -> tuple[httpx.Response, list[Event]]:
    async with http.stream("POST", URL, json=SHORT, headers=auth(caller)) as response:
        return response, await read_all(response)


async def resumed(http: httpx.AsyncClient, caller: Caller, request_id: str, *, starting_after: int | None = None,
                  last_event_id: str | None = None, post: bool = False) -> list[Event]:
    """The stream from where the client says it is: GET with ``starting_after`` and/or ``Last-Event-ID`` (neither:
    from its start), or POST with ``Last-Event-ID``."""
    headers = auth(caller) | ({"Last-Event-ID": last_event_id} if last_event_id else {})
    if post:
        request = http.stream("POST", URL, json=SHORT, headers=headers)
    else:
        params = {"stream": "true"} | ({"starting_after": str(starting_after)} if starting_after is not None else {})
        request = http.stream("GET", f"{URL}/{request_id}", params=params, headers=headers)
    async with request as response:
        return await read_all(response)


def after(stream: list[Event], at: int) -> list[Event]:
    return [event for event in stream if position(event) > at]


def text(stream: list[Event]) -> str:
    return "".join(t for _, t in stream)


def is_the_rest(resumed: list[Event], first: list[Event], at: int) -> bool:
    """Exactly what ``first`` has after position ``at``: the same text, to the same last event (a gateway reading
    the log may merge deltas into fewer events than the first one did; positions tell where each ends)."""
    return (text(resumed) == text(after(first, at)) and all(position(e) > at for e in resumed)
            and resumed[-1] == first[-1])


async def test_a_stream_resumed_from_a_position_gets_exactly_the_events_after_it(gateway: ServiceProcess,
                                                                                  caller: Caller) -> None:
    async with httpx.AsyncClient(timeout=120) as http:
        _, first = await streamed(http, caller)
        request_id = first[0][0].rpartition(":")[0]
        middle, early = position(first[len(first) // 2]), position(first[2])
        replayed = await resumed(http, caller, request_id)
        by_position = await resumed(http, caller, request_id, starting_after=middle)
        by_header = await resumed(http, caller, request_id, last_event_id=f"{request_id}:{middle}")
        by_post = await resumed(http, caller, request_id, last_event_id=f"{request_id}:{early}", post=True)
    assert len(first) >= 8 and text(after(first, middle)) and text(first) != text(after(first, middle))
    assert is_the_rest(replayed, first, -1)  # neither: the whole stream
    assert is_the_rest(by_position, first, middle), (middle, first, by_position)
    assert is_the_rest(by_header, first, middle), (middle, first, by_header)
    assert is_the_rest(by_post, first, early), (early, first, by_post)


async def test_a_key_whose_requests_per_minute_are_spent_still_resumes_its_streams(  # type: ignore[no-untyped-def]
        gateway: ServiceProcess, make_caller) -> None:
    """A resume takes nothing from the request limit; it takes one read from the read limit, which has as many a
    minute as the org's requests (docs/OPERATIONS.md): two a minute here, for two requests and two resumes."""
    two_a_minute = make_caller(org=f"org-resume-rpm-{SESSION}", tier="plus",
                               limits=Limits(requests_per_minute=2, max_concurrent=1000))
    async with httpx.AsyncClient(timeout=120) as http:
        _, first = await streamed(http, two_a_minute)
        answered, second = await streamed(http, two_a_minute)
        refused = await http.post(URL, json=SHORT, headers=auth(two_a_minute))
        request_ids = [stream[0][0].rpartition(":")[0] for stream in (first, second)]
        at, at_second = position(first[3]), position(second[3])
        by_get = await resumed(http, two_a_minute, request_ids[0], starting_after=at)
        by_post = await resumed(http, two_a_minute, request_ids[1], last_event_id=f"{request_ids[1]}:{at_second}",
                                post=True)
        still_refused = await http.post(URL, json=SHORT, headers=auth(two_a_minute))
    assert answered.headers["x-ratelimit-remaining-requests"] == "0"
    assert refused.status_code == 429 and refused.json()["error"]["type"] == "requests", refused.text
    assert is_the_rest(by_get, first, at) and is_the_rest(by_post, second, at_second)
    assert still_refused.status_code == 429  # and nothing was given back: the minute's requests stay spent
