"""Conversation writes are admitted and accounted (issue 37 H3), through the real gateway and Cassandra: a create
and a metadata update are requests of the key's rate limit (429 ``rate_limit_exceeded`` past it); an org whose
conversations keep its whole storage quota gets 429 ``insufficient_quota`` for a create that would pass it; an
item longer than the gateway takes is a 400 naming it. The review's exploit (creates of 20 items of 50,000
characters in a loop, always 201) is now bounded by all three."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from producers.tenancy.admin import UNLIMITED, Limits
from runtime.cassandra_client import connect_async, execute
from runtime.settings import Settings
from tests.conftest import SESSION, Caller

pytestmark = pytest.mark.e2e


def http_client(base_url: str, caller: Caller) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=base_url, headers={"authorization": f"Bearer {caller.secret}"}, timeout=60)


async def test_conversation_writes_are_requests_of_the_keys_rate_limit(
        base_url: str, make_caller) -> None:  # type: ignore[no-untyped-def]
    limited = make_caller(org=f"org-conv-writes-{SESSION}", limits=Limits(requests_per_minute=3))
    async with http_client(base_url, limited) as http:
        first = await http.post("/conversations", json={"items": [{"role": "user", "content": "hi"}]})
        assert first.status_code == 200, first.text
        conversation_id = first.json()["id"]
        assert (await http.post(f"/conversations/{conversation_id}", json={"metadata": {"k": "v"}})).status_code == 200
        assert (await http.post("/conversations", json={})).status_code == 200
        refused = [await http.post("/conversations", json={}),
                   await http.post(f"/conversations/{conversation_id}", json={"metadata": {"k": "w"}})]
        for answer in refused:
            assert answer.status_code == 429, answer.text
            assert answer.json()["error"]["code"] == "rate_limit_exceeded" and "retry-after" in answer.headers
        assert (await http.get(f"/conversations/{conversation_id}")).json()["metadata"] == {"k": "v"}


async def test_a_create_past_the_orgs_storage_quota_is_refused_and_an_item_too_long_is_named(
        base_url: str, make_caller, stack: Settings) -> None:  # type: ignore[no-untyped-def]
    org = f"org-conv-quota-{SESSION}"
    caller = make_caller(org=org, tier="free", limits=UNLIMITED)
    quota = stack.tenancy.tiers.policy("free").conversation_storage_bytes
    cluster, session = await connect_async(stack.cassandra)
    try:  # the org's conversations keep all but 1,000 bytes of its quota
        await execute(session, f"UPDATE {stack.cassandra.keyspace}.conversation_storage SET bytes = bytes + %s "
                               "WHERE org_id = %s", [quota - 1000, org])
    finally:
        await asyncio.to_thread(cluster.shutdown)
    async with http_client(base_url, caller) as http:
        fits = await http.post("/conversations", json={"items": [{"role": "user", "content": "hi"}]})
        assert fits.status_code == 200, fits.text
        past = await http.post("/conversations", json={"items": [{"role": "user", "content": "x" * 1000}]})
        assert past.status_code == 429, past.text
        error = past.json()["error"]
        assert (error["type"], error["code"]) == ("insufficient_quota", "storage_quota_exceeded"), error
        assert "retry-after" not in past.headers

        too_long = "y" * (stack.gateway.conversation_item_max_chars + 1)
        answer = await http.post("/conversations", json={"items": [{"role": "user", "content": "ok"},
                                                                   {"role": "user", "content": too_long}]})
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "items[1].content", answer.text
