"""Orgs and keys through the admin HTTP API, seen by three gateway processes: a revoked key is refused by all of
them within a second, an expired key and a key outside its model allow-list are refused, and bad admin input is
a 4xx in OpenAI's error shape that writes nothing."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest

from producers.tenancy.admin import OPERATORS_ORG
from tests.conftest import GATEWAY_PORT, Caller
from tests.e2e.conftest import MODEL, QUESTION, kns
from tests.helpers import ServiceProcess, wait_for

pytestmark = pytest.mark.e2e
@pytest.fixture(scope="module")
def admin_key(make_caller) -> str:  # type: ignore[no-untyped-def]
    caller: Caller = make_caller(org=OPERATORS_ORG, tier="enterprise", admin=True)
    return caller.secret


def _url(port: int, path: str) -> str:
    return f"http://127.0.0.1:{port}{path}"


def _auth(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


def _new_org() -> str:
    return f"org-ten-{uuid.uuid4().hex[:10]}"


async def _admin(http: httpx.AsyncClient, admin_key: str, method: str, path: str, body: Any = None,
                 port: int = GATEWAY_PORT) -> httpx.Response:
    return await http.request(method, _url(port, f"/v1/admin{path}"), headers=_auth(admin_key),
                              json=body)


async def _org_with_key(http: httpx.AsyncClient, admin_key: str, **key: Any) -> tuple[str, dict[str, Any]]:
    org = _new_org()
    created = await _admin(http, admin_key, "POST", "/orgs", {"org_id": org, "tier": "plus"})
    assert created.status_code == 201, created.text
    issued = await _admin(http, admin_key, "POST", f"/orgs/{org}/keys", {"name": "k", **key})
    assert issued.status_code == 201, issued.text
    return org, issued.json()


async def test_a_revoked_key_gets_401_on_every_gateway_within_a_second(three_gateways: tuple[int, ...],
                                                                      admin_key: str) -> None:
    async with httpx.AsyncClient(timeout=30) as http:
        _, key = await _org_with_key(http, admin_key)
        secret = key["value"]
        # Issued through gateway A, usable at once through B and C (a miss catches up with the registry).
        for port in three_gateways:
            ok = await http.get(_url(port, "/v1/models"), headers=_auth(secret))
            assert ok.status_code == 200, (port, ok.text)

        revoked = await _admin(http, admin_key, "DELETE", f"/keys/{key['id']}", port=three_gateways[1])
        assert revoked.status_code == 200 and revoked.json()["revoked_at"] is not None
        acknowledged = time.monotonic()

        async def refused_after(port: int) -> float:
            while True:
                answer = await http.get(_url(port, "/v1/models"), headers=_auth(secret))
                if answer.status_code == 401:
                    assert answer.json()["error"]["code"] == "invalid_api_key"
                    return time.monotonic() - acknowledged
                assert answer.status_code == 200
                await asyncio.sleep(0.02)

        delays = await asyncio.wait_for(asyncio.gather(*(refused_after(p) for p in three_gateways)), 10)
    assert max(delays) < 1.0, f"revocation reached the gateways after {delays} s"


async def test_an_expired_key_gets_401(gateway: ServiceProcess, admin_key: str) -> None:
    async with httpx.AsyncClient(timeout=30) as http:
        expires = datetime.now(UTC) + timedelta(seconds=3)
        _, key = await _org_with_key(http, admin_key, expires_at=expires.isoformat())
        assert (await http.get(_url(GATEWAY_PORT, "/v1/models"), headers=_auth(key["value"]))).status_code == 200
        await asyncio.sleep(max(0.0, (expires - datetime.now(UTC)).total_seconds()) + 0.2)
        answer = await http.get(_url(GATEWAY_PORT, "/v1/models"), headers=_auth(key["value"]))
    assert answer.status_code == 401
    assert answer.json()["error"]["code"] == "expired_api_key"


async def test_a_model_outside_the_keys_allow_list_gets_403(gateway: ServiceProcess, admin_key: str) -> None:
    async with httpx.AsyncClient(timeout=120) as http:
        _, narrow = await _org_with_key(http, admin_key, models=["some-other-model"])
        _, allowed = await _org_with_key(http, admin_key, models=[MODEL])
        body = {"model": MODEL, "messages": QUESTION, "max_tokens": 2}
        refused = await http.post(_url(GATEWAY_PORT, "/v1/chat/completions"), headers=_auth(narrow["value"]),
                                  json=body)
        served = await http.post(_url(GATEWAY_PORT, "/v1/chat/completions"), headers=_auth(allowed["value"]),
                                 json=body)
    assert refused.status_code == 403, refused.text
    assert refused.json()["error"] | {"message": ""} == {
        "message": "", "type": "permission_error", "param": "model", "code": "model_not_allowed"}
    assert served.status_code == 200, served.text


async def test_a_rotated_key_keeps_its_old_secret_until_the_grace_ends_then_revocation_stops_the_new_one(
        gateway: ServiceProcess, admin_key: str) -> None:
    grace_s = 3
    async with httpx.AsyncClient(timeout=30) as http:
        _, key = await _org_with_key(http, admin_key)
        asked = datetime.now(UTC)
        rotated = await _admin(http, admin_key, "POST", f"/keys/{key['id']}/rotate", {"grace_s": grace_s})
        assert rotated.status_code == 200, rotated.text
        new = rotated.json()
        assert new["id"] == key["id"] and new["value"] != key["value"]
        for secret in (key["value"], new["value"]):
            assert (await http.get(_url(GATEWAY_PORT, "/v1/models"), headers=_auth(secret))).status_code == 200

        async def old_refused() -> bool:
            answer = await http.get(_url(GATEWAY_PORT, "/v1/models"), headers=_auth(key["value"]))
            assert answer.status_code in (200, 401), answer.text
            return answer.status_code == 401

        await wait_for(old_refused, timeout_s=grace_s + 10, interval_s=0.1, what="the old secret refused")
        assert datetime.now(UTC) >= asked + timedelta(seconds=grace_s), "the old secret stopped before its grace"
        assert (await http.get(_url(GATEWAY_PORT, "/v1/models"), headers=_auth(new["value"]))).status_code == 200
        assert (await _admin(http, admin_key, "DELETE", f"/keys/{key['id']}")).status_code == 200
        for secret in (key["value"], new["value"]):
            assert (await http.get(_url(GATEWAY_PORT, "/v1/models"), headers=_auth(secret))).status_code == 401


async def test_an_admin_key_is_for_the_admin_api_only(gateway: ServiceProcess, admin_key: str) -> None:
    async with httpx.AsyncClient(timeout=30) as http:
        answer = await http.get(_url(GATEWAY_PORT, "/v1/models"), headers=_auth(admin_key))
    assert answer.status_code == 403 and answer.json()["error"]["code"] == "admin_key_not_allowed"


async def test_bad_admin_input_gets_a_4xx_in_openai_shape_and_writes_nothing(gateway: ServiceProcess,
                                                                             admin_key: str,
                                                                             caller: Caller) -> None:
    bad_org = _new_org()
    async with httpx.AsyncClient(timeout=30) as http:
        org, _ = await _org_with_key(http, admin_key)
        cases: list[tuple[str, str, str, Any, int, str | None]] = [
            ("negative limit", "POST", "/orgs",
             {"org_id": bad_org, "tier": "free", "limits": {"requests_per_minute": -5}}, 400, "invalid_value"),
            ("unknown tier", "POST", "/orgs", {"org_id": bad_org, "tier": "platinum"}, 400, "unknown_tier"),
            ("bad org id", "POST", "/orgs", {"org_id": "Not An Id!", "tier": "free"}, 400, "invalid_value"),
            ("unknown field", "POST", "/orgs", {"org_id": bad_org, "tier": "free", "colour": "red"}, 400,
             "unknown_parameter"),
            ("missing tier", "POST", "/orgs", {"org_id": bad_org}, 400, "missing_required_parameter"),
            ("negative budget", "POST", "/orgs", {"org_id": bad_org, "tier": "free", "monthly_budget_usd": -1},
             400, "invalid_value"),
            ("existing org", "POST", "/orgs", {"org_id": org, "tier": "free"}, 409, "organization_exists"),
            ("key for unknown org", "POST", f"/orgs/{bad_org}/keys", {"name": "x"}, 404,
             "organization_not_found"),
            ("expiry in the past", "POST", f"/orgs/{org}/keys", {"expires_at": "2020-01-01T00:00:00Z"}, 400,
             "invalid_expiry"),
            # review findings: each of these was a 500 or was accepted
            ("expiry without a zone", "POST", f"/orgs/{org}/keys", {"expires_at": "2020-01-01T00:00:00"}, 400,
             "invalid_expiry"),
            ("limit beyond its type", "POST", "/orgs",
             {"org_id": bad_org, "tier": "free", "limits": {"max_concurrent": 2**31}}, 400, "invalid_value"),
            ("limit as a bool", "POST", "/orgs",
             {"org_id": bad_org, "tier": "free", "limits": {"requests_per_minute": True}}, 400, "invalid_value"),
            ("org id with a newline", "POST", "/orgs", {"org_id": bad_org + "\n", "tier": "free"}, 400,
             "invalid_value"),
            ("admin as a string", "POST", f"/orgs/{org}/keys", {"admin": "true"}, 400, "invalid_value"),
            ("body not an object", "POST", "/orgs", [1, 2], 400, "invalid_json"),
            ("unknown tier on update", "PATCH", f"/orgs/{org}", {"tier": "platinum"}, 400, "unknown_tier"),
            ("unknown org on update", "PATCH", f"/orgs/{bad_org}", {"tier": "free"}, 404,
             "organization_not_found"),
            ("unknown key", "DELETE", "/keys/key_nope", None, 404, "api_key_not_found"),
            ("negative grace", "POST", "/keys/key_nope/rotate", {"grace_s": -1}, 400, "invalid_value"),
        ]
        for name, method, path, body, status, code in cases:
            answer = await _admin(http, admin_key, method, path, body)
            assert answer.status_code == status, (name, answer.text)
            error = answer.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["code"] == code, (name, error)

        malformed = await http.post(_url(GATEWAY_PORT, "/v1/admin/orgs"), headers={
            **_auth(admin_key), "content-type": "application/json"}, content=b'{"org_id": ')
        assert malformed.status_code == 400 and malformed.json()["error"]["code"] == "invalid_json"
        not_admin = await http.post(_url(GATEWAY_PORT, "/v1/admin/orgs"), headers=_auth(caller.secret),
                                    json={"org_id": bad_org, "tier": "free"})
        assert not_admin.status_code == 403 and not_admin.json()["error"]["code"] == "insufficient_permissions"
        anonymous = await http.get(_url(GATEWAY_PORT, "/v1/admin/orgs"))
        assert anonymous.status_code == 401

        # Nothing was half-written: the org of the refused requests does not exist, the good org is unchanged.
        assert (await _admin(http, admin_key, "GET", f"/orgs/{bad_org}")).status_code == 404
        unchanged = (await _admin(http, admin_key, "GET", f"/orgs/{org}")).json()
        assert unchanged["tier"] == "plus"
        listed = (await _admin(http, admin_key, "GET", f"/orgs/{org}/keys")).json()["data"]
        assert len(listed) == 1 and "value" not in listed[0]


async def _limits_in_force(http: httpx.AsyncClient, port: int, secret: str) -> dict[str, str]:
    """The limits a gateway admits the key's requests against, as the headers of its answer say (the org has a
    budget of 0: every request is refused at once, with those headers, and nothing is generated)."""
    answer = await http.post(_url(port, "/v1/chat/completions"), headers=_auth(secret),
                             json={"model": MODEL, "messages": QUESTION, "max_tokens": 1})
    assert answer.status_code == 429 and answer.json()["error"]["code"] == "insufficient_quota", answer.text
    return {kind: answer.headers[f"x-ratelimit-limit-{kind}"] for kind in ("requests", "tokens")}


@pytest.mark.timeout(240)  # two CLI runs (each reads the registry)
async def test_orgs_update_changes_every_limit_create_sets_and_every_gateway_applies_a_change_within_a_second(
        three_gateways: tuple[int, ...], admin_key: str, service_env: dict[str, str]) -> None:
    org = _new_org()
    created = await asyncio.to_thread(kns, service_env, "orgs", "create", org, "--tier", "free", "--rpm", "60",
                                      "--concurrent", "500", "--json")
    assert created.returncode == 0, created.stdout + created.stderr
    assert json.loads(created.stdout)[0]["limits"] == {
        "requests_per_minute": 60, "tokens_per_minute": None, "max_concurrent": 500}
    updated = await asyncio.to_thread(kns, service_env, "orgs", "update", org, "--rpm", "90", "--tpm", "30000",
                                      "--concurrent", "tier", "--name", "Renamed", "--budget-usd", "0", "--json")
    assert updated.returncode == 0, updated.stdout + updated.stderr
    org_json = json.loads(updated.stdout)[0]
    assert org_json["limits"] == {"requests_per_minute": 90, "tokens_per_minute": 30000, "max_concurrent": None}
    assert (org_json["name"], org_json["tier"], org_json["monthly_budget_usd"]) == ("Renamed", "free", "0")
    refused = await asyncio.to_thread(kns, service_env, "orgs", "update", org, "--rpm", "lots")
    assert refused.returncode == 2 and "--rpm" in refused.stdout + refused.stderr

    async with httpx.AsyncClient(timeout=30) as http:
        issued = await _admin(http, admin_key, "POST", f"/orgs/{org}/keys", {"name": "k"})
        secret = issued.json()["value"]
        for port in three_gateways:
            assert await _limits_in_force(http, port, secret) == {"requests": "90", "tokens": "30000"}

        patched = await _admin(http, admin_key, "PATCH", f"/orgs/{org}",
                               {"limits": {"requests_per_minute": 120, "tokens_per_minute": None}},
                               port=three_gateways[1])
        assert patched.status_code == 200, patched.text
        acknowledged = time.monotonic()

        async def applied_after(port: int) -> float:
            while True:
                if await _limits_in_force(http, port, secret) == {"requests": "120", "tokens": "20000"}:
                    return time.monotonic() - acknowledged
                await asyncio.sleep(0.02)

        delays = await asyncio.wait_for(asyncio.gather(*(applied_after(p) for p in three_gateways)), 10)
    assert max(delays) < 1.0, f"the new limits reached the gateways after {delays} s"


async def test_an_org_admin_administers_its_own_org_alone(gateway: ServiceProcess, admin_key: str) -> None:
    """Review finding M4: an admin key of any org administered every org."""
    async with httpx.AsyncClient(timeout=30) as http:
        own, _ = await _org_with_key(http, admin_key)
        victim, victims_key = await _org_with_key(http, admin_key)
        minted = await _admin(http, admin_key, "POST", f"/orgs/{own}/keys", {"name": "org admin", "admin": True})
        assert minted.status_code == 201 and minted.json()["admin"] is True, minted.text
        org_admin = minted.json()["value"]
        operator = await _admin(http, admin_key, "POST", f"/orgs/{OPERATORS_ORG}/keys", {"admin": True})
        assert operator.status_code == 403 and operator.json()["error"]["param"] == "admin", operator.text

        listed = await _admin(http, org_admin, "GET", "/orgs")
        assert [o["id"] for o in listed.json()["data"]] == [own]
        for method, path, body in [("GET", f"/orgs/{victim}", None), ("PATCH", f"/orgs/{victim}", {"name": "x"}),
                                   ("GET", f"/orgs/{victim}/keys", None), ("POST", f"/orgs/{victim}/keys", {}),
                                   ("GET", f"/keys/{victims_key['id']}", None),
                                   ("POST", f"/keys/{victims_key['id']}/rotate", {}),
                                   ("DELETE", f"/keys/{victims_key['id']}", None),
                                   ("POST", f"/orgs/{OPERATORS_ORG}/keys", {"admin": True})]:
            answer = await _admin(http, org_admin, method, path, body)
            assert answer.status_code == 404, (method, path, answer.text)
        for body, param in [({"tier": "enterprise"}, "tier"),
                            ({"limits": {"requests_per_minute": 601}}, "limits.requests_per_minute")]:
            answer = await _admin(http, org_admin, "PATCH", f"/orgs/{own}", body)
            assert answer.status_code == 403 and answer.json()["error"] | {"message": ""} == {
                "message": "", "type": "permission_error", "param": param, "code": "insufficient_permissions"}
        created = await _admin(http, org_admin, "POST", "/orgs", {"org_id": _new_org(), "tier": "enterprise"})
        assert created.status_code == 403, created.text

        # its own org it administers: limits within the tier, budget, keys (an org admin of its own too)
        lowered = await _admin(http, org_admin, "PATCH", f"/orgs/{own}",
                               {"limits": {"requests_per_minute": 100}, "monthly_budget_usd": "50"})
        assert lowered.status_code == 200 and lowered.json()["limits"]["requests_per_minute"] == 100, lowered.text
        key = await _admin(http, org_admin, "POST", f"/orgs/{own}/keys", {"name": "ci"})
        assert key.status_code == 201 and key.json()["org_id"] == own
        assert (await http.get(_url(GATEWAY_PORT, "/v1/models"), headers=_auth(key.json()["value"]))).status_code == 200

        # the victim is as it was, and its key still works
        unchanged = (await _admin(http, admin_key, "GET", f"/orgs/{victim}")).json()
        assert (unchanged["name"], unchanged["tier"]) == (victim, "plus")
        served = await http.get(_url(GATEWAY_PORT, "/v1/models"), headers=_auth(victims_key["value"]))
        assert served.status_code == 200
