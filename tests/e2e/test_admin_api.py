"""The admin API's reads and updates over HTTP: orgs are listed and read, a key is read without its secret, and a
PATCH changes what the org's callers get at once (a budget that refuses them, ``"monthly_budget_usd": null`` that
serves them again, a tier and a limit in the rate-limit headers); only the fields given change."""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import pytest

from producers.tenancy.admin import OPERATORS_ORG
from tests.conftest import GATEWAY_PORT, Caller
from tests.e2e.conftest import MODEL
from tests.helpers import ServiceProcess, wait_for

pytestmark = pytest.mark.e2e

ADMIN = f"http://127.0.0.1:{GATEWAY_PORT}/v1/admin"
CHAT = f"http://127.0.0.1:{GATEWAY_PORT}/v1/chat/completions"


@pytest.fixture(scope="module")
def admin_key(gateway: ServiceProcess, make_caller) -> str:  # type: ignore[no-untyped-def]
    """An admin key, and the session's gateway up to use it."""
    caller: Caller = make_caller(org=OPERATORS_ORG, tier="enterprise", admin=True)
    return caller.secret


async def admin(http: httpx.AsyncClient, secret: str, method: str, path: str, body: Any = None) -> Any:
    response = await http.request(method, f"{ADMIN}{path}", headers={"Authorization": f"Bearer {secret}"},
                                  json=body)
    assert response.status_code in (200, 201), (method, path, response.status_code, response.text)
    return response.json()


async def ask(http: httpx.AsyncClient, secret: str) -> httpx.Response:
    return await http.post(CHAT, headers={"Authorization": f"Bearer {secret}"},
                           json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1})


async def test_orgs_are_listed_and_read_and_a_key_is_read_without_its_secret(admin_key: str) -> None:
    org = f"org-admin-{uuid.uuid4().hex[:10]}"
    async with httpx.AsyncClient(timeout=30) as http:
        created = await admin(http, admin_key, "POST", "/orgs", {
            "org_id": org, "tier": "plus", "name": "Reads", "limits": {"requests_per_minute": 77},
            "monthly_budget_usd": "12.5"})
        issued = await admin(http, admin_key, "POST", f"/orgs/{org}/keys", {"name": "reader", "models": [MODEL]})
        listed = await admin(http, admin_key, "GET", "/orgs")
        read = await admin(http, admin_key, "GET", f"/orgs/{org}")
        key = await admin(http, admin_key, "GET", f"/keys/{issued['id']}")
    assert listed["object"] == "list"
    (mine,) = [o for o in listed["data"] if o["id"] == org]
    assert mine == read == created
    assert (read["name"], read["tier"], read["limits"]["requests_per_minute"], read["monthly_budget_usd"]) == (
        "Reads", "plus", 77, "12.5")
    assert OPERATORS_ORG in {o["id"] for o in listed["data"]}  # every org, not only the newest
    assert "value" in issued and "value" not in key  # the secret is shown once, at issue
    assert {k: v for k, v in issued.items() if k != "value"} == key
    assert (key["object"], key["org_id"], key["name"], key["models"], key["revoked_at"]) == (
        "api_key", org, "reader", [MODEL], None)


async def test_a_patch_changes_what_the_orgs_callers_get_and_a_null_budget_removes_it(admin_key: str) -> None:
    org = f"org-admin-{uuid.uuid4().hex[:10]}"
    async with httpx.AsyncClient(timeout=60) as http:
        await admin(http, admin_key, "POST", "/orgs", {"org_id": org, "tier": "plus", "name": "Patched"})
        secret = (await admin(http, admin_key, "POST", f"/orgs/{org}/keys", {}))["value"]
        assert (await ask(http, secret)).status_code == 200

        # No budget left for a request's hold: the org's next request is refused.
        budgeted = await admin(http, admin_key, "PATCH", f"/orgs/{org}", {"monthly_budget_usd": "0"})
        assert float(budgeted["monthly_budget_usd"]) == 0 and budgeted["name"] == "Patched"

        async def refused_for_quota() -> bool:
            answer = await ask(http, secret)
            return answer.status_code == 429 and answer.json()["error"]["code"] == "insufficient_quota"

        assert await wait_for(refused_for_quota, timeout_s=10, what="the budget applied")

        unbudgeted = await admin(http, admin_key, "PATCH", f"/orgs/{org}", {"monthly_budget_usd": None})
        assert unbudgeted["monthly_budget_usd"] is None
        assert (await admin(http, admin_key, "GET", f"/orgs/{org}"))["monthly_budget_usd"] is None

        async def served() -> bool:
            return (await ask(http, secret)).status_code == 200

        assert await wait_for(served, timeout_s=10, what="the budget removed")

        moved = await admin(http, admin_key, "PATCH", f"/orgs/{org}",
                            {"tier": "enterprise", "limits": {"requests_per_minute": 5}})
        assert (moved["tier"], moved["limits"]["requests_per_minute"]) == ("enterprise", 5)
        assert moved["name"] == "Patched" and moved["monthly_budget_usd"] is None  # the fields not given stay

        async def limited_to_five() -> bool:
            return (await ask(http, secret)).headers.get("x-ratelimit-limit-requests") == "5"

        assert await wait_for(limited_to_five, timeout_s=10, what="the new limit applied")
        answer = await ask(http, secret)
        # the tokens per minute now come from the enterprise tier (5,000,000), the org's own rpm override stays
        assert answer.headers["x-ratelimit-limit-tokens"] == "5000000", dict(answer.headers)
