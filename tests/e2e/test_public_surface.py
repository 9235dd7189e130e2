"""What the gateway's public port tells a caller without a key (review finding L4): whether it serves, the public
API's document; nothing about tenants, instances or its metrics. Those are on its internal port (its port + 50);
the admin API's document is for admin keys."""

from __future__ import annotations

import httpx
import pytest

from producers.tenancy.admin import OPERATORS_ORG
from tests.conftest import GATEWAY_PORT, Caller
from tests.helpers import ServiceProcess

pytestmark = pytest.mark.e2e

PUBLIC, INTERNAL = f"http://127.0.0.1:{GATEWAY_PORT}", f"http://127.0.0.1:{GATEWAY_PORT + 50}"


def test_the_public_health_says_only_whether_the_gateway_serves(gateway: ServiceProcess) -> None:
    public = httpx.get(f"{PUBLIC}/health", timeout=10)
    assert public.status_code == 200 and public.json() == {"status": "ok"}
    internal = httpx.get(f"{INTERNAL}/health", timeout=10).json()
    assert internal["status"] == "ok" and internal["gateway_id"] and internal["registry"]["following"] is True
    assert {"instance", "reply_partition", "reply_lease"} <= set(internal) and "orgs" in internal["registry"]


def test_metrics_are_served_on_the_internal_port_only(gateway: ServiceProcess) -> None:
    public = httpx.get(f"{PUBLIC}/metrics", timeout=10)
    assert public.status_code == 404 and public.json()["error"]["code"] == "not_found"
    internal = httpx.get(f"{INTERNAL}/metrics", timeout=10)
    assert internal.status_code == 200 and "kns_gateway_requests_total" in internal.text


def test_the_admin_api_is_documented_for_admin_keys_only(gateway: ServiceProcess, make_caller, caller: Caller  # type: ignore[no-untyped-def]
                                                         ) -> None:
    public = httpx.get(f"{PUBLIC}/openapi.json", timeout=10).json()["paths"]
    assert "/v1/chat/completions" in public and not [p for p in public if p.startswith("/v1/admin")]
    admin: Caller = make_caller(org=OPERATORS_ORG, tier="enterprise", admin=True)
    document = httpx.get(f"{PUBLIC}/v1/admin/openapi.json", headers={"Authorization": f"Bearer {admin.secret}"},
                         timeout=10)
    assert document.status_code == 200 and "/v1/admin/orgs/{org_id}/keys" in document.json()["paths"]
    assert httpx.get(f"{PUBLIC}/v1/admin/openapi.json", timeout=10).status_code == 401
    not_admin = httpx.get(f"{PUBLIC}/v1/admin/openapi.json", headers={"Authorization": f"Bearer {caller.secret}"},
                          timeout=10)
    assert not_admin.status_code == 403
