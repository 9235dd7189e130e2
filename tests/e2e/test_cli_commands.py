"""The operator's and the user's commands of docs/OPERATIONS.md against the session's stack, each checked by what
it printed and by what it did: ``kns chat`` streams an answer through the gateway; ``kns orgs create|update|list``
and ``kns keys create|list|rotate|revoke`` change what a caller gets; ``kns keys create-admin`` makes a key for the
admin API only; ``kns topics`` counts what a request adds; ``kns billing prices`` shows the seeded price table;
``kns stack status|logs`` show the running services. (``kns keys suspended``: test_token_velocity.py; ``kns
safety eval``: tests/unit/test_safety_embeddings.py; ``kns tokens``: test_cli.py.)"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import uuid
from typing import Any

import httpx
import openai
import pytest

from billing.prices import load_seed
from ops.stack.manager import StackManager
from producers.tenancy.admin import OPERATORS_ORG
from runtime.settings import Settings
from schemas.topics import TOPICS
from tests.conftest import GATEWAY_PORT, Caller
from tests.e2e.conftest import MODEL, QUESTION, kns, token_records
from tests.helpers import wait_for

pytestmark = pytest.mark.e2e

V1 = f"http://127.0.0.1:{GATEWAY_PORT}/v1"


async def run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    done = await asyncio.to_thread(kns, env, *args)
    assert done.returncode == 0, f"kns {' '.join(args)}: {done.stdout}\n{done.stderr}"
    return done  # type: ignore[no-any-return]


async def run_json(env: dict[str, str], *args: str) -> Any:
    return json.loads((await run(env, *args, "--json")).stdout)


def issued(stdout: str) -> tuple[str, str]:
    """(key id, secret) of what ``kns keys create|create-admin|rotate`` printed."""
    first, secret = stdout.strip().splitlines()[-2:]
    match = re.match(r"key_id=(\S+) org=(\S+)", first)
    assert match and secret.startswith("sk-"), stdout
    return match.group(1), secret.strip()


async def status_of(http: httpx.AsyncClient, secret: str) -> httpx.Response:
    return await http.post(f"{V1}/chat/completions", headers={"Authorization": f"Bearer {secret}"},
                           json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1})


async def test_kns_chat_streams_an_answer_through_the_gateway(gateway: object, caller: Caller, stack: Settings,
                                                             service_env: dict[str, str]) -> None:
    out = await run(service_env, "chat", "What is the capital of France?", "--api-key", caller.secret,
                    "--max-tokens", "16")
    assert "Paris" in out.stdout, out.stdout
    summary = re.search(r"(chatcmpl-\S+) · (\d+) prompt \+ (\d+) completion tokens", out.stdout)
    assert summary, out.stdout
    request_id, completion = summary.group(1), int(summary.group(3))
    assert 0 < completion <= 16
    # It went through the platform: its tokens are in the log, as many as it says.
    records = await token_records(stack, request_id)
    assert sum(len(event.token_ids) for _, event in records) == completion


async def test_kns_orgs_and_keys_change_what_a_caller_gets(service_env: dict[str, str], gateway: object) -> None:
    org = f"org-cli-{uuid.uuid4().hex[:10]}"
    (created,) = await run_json(service_env, "orgs", "create", org, "--tier", "plus", "--tpm", "400000")
    assert (created["id"], created["tier"], created["limits"]["tokens_per_minute"]) == (org, "plus", 400000)
    key_id, secret = issued((await run(service_env, "keys", "create", "--org", org, "--name", "cli")).stdout)
    async with httpx.AsyncClient(timeout=60) as http:
        answered = await status_of(http, secret)
        assert answered.status_code == 200, answered.text
        # the org's own tokens per minute, its tier's requests per minute
        assert (answered.headers["x-ratelimit-limit-tokens"], answered.headers["x-ratelimit-limit-requests"]) == (
            "400000", "600")

        async def header(name: str, value: str) -> bool:
            return (await status_of(http, secret)).headers.get(name) == value

        (updated,) = await run_json(service_env, "orgs", "update", org, "--tier", "enterprise")
        assert updated["tier"] == "enterprise" and updated["limits"]["tokens_per_minute"] == 400000
        await wait_for(lambda: header("x-ratelimit-limit-requests", "6000"), timeout_s=10,
                       what="the enterprise tier's requests per minute")
        (budgeted,) = await run_json(service_env, "orgs", "update", org, "--budget-usd", "0")
        assert float(budgeted["monthly_budget_usd"]) == 0

        async def refused_for_quota() -> bool:
            answer = await status_of(http, secret)
            return answer.status_code == 429 and answer.json()["error"]["code"] == "insufficient_quota"

        await wait_for(refused_for_quota, timeout_s=10, what="the org refused past its budget")
        (unbudgeted,) = await run_json(service_env, "orgs", "update", org, "--budget-usd", "none")
        assert unbudgeted["monthly_budget_usd"] is None and unbudgeted["tier"] == "enterprise"

        async def served() -> bool:
            return (await status_of(http, secret)).status_code == 200

        await wait_for(served, timeout_s=10, what="the org served again without a budget")
        listed = {o["id"]: o for o in await run_json(service_env, "orgs", "list")}
        assert (listed[org]["tier"], listed[org]["monthly_budget_usd"]) == ("enterprise", None)
        (key,) = await run_json(service_env, "keys", "list", "--org", org)
        assert (key["id"], key["name"], key["revoked_at"]) == (key_id, "cli", None) and "value" not in key

        rotated_id, new_secret = issued((await run(service_env, "keys", "rotate", key_id)).stdout)
        assert rotated_id == key_id and new_secret != secret
        assert (await status_of(http, new_secret)).status_code == 200

        async def refused(which: str) -> bool:
            return (await status_of(http, which)).status_code == 401

        await wait_for(lambda: refused(secret), timeout_s=10, what="the old secret refused (no grace)")
        (revoked,) = await run_json(service_env, "keys", "revoke", key_id)
        assert revoked["id"] == key_id and revoked["revoked_at"] is not None
        await wait_for(lambda: refused(new_secret), timeout_s=10, what="the revoked key refused")


async def test_kns_keys_create_admin_makes_a_key_for_the_admin_api_only(service_env: dict[str, str],
                                                                       gateway: object) -> None:
    out = await run(service_env, "keys", "create-admin", "--name", "cli-admin")
    assert f"org={OPERATORS_ORG} admin" in out.stdout
    _, secret = issued(out.stdout)
    auth = {"Authorization": f"Bearer {secret}"}
    async with httpx.AsyncClient(timeout=30) as http:
        orgs = await http.get(f"{V1}/admin/orgs", headers=auth)
        models = await http.get(f"{V1}/models", headers=auth)
    assert orgs.status_code == 200 and OPERATORS_ORG in {o["id"] for o in orgs.json()["data"]}
    assert models.status_code == 403 and models.json()["error"]["code"] == "admin_key_not_allowed"


async def test_kns_topics_counts_the_records_a_request_adds(client: openai.OpenAI, stack: Settings,
                                                           service_env: dict[str, str]) -> None:
    submitted = stack.kafka.topic(TOPICS.requests_submitted.name)

    async def offsets() -> int:
        return next(t["offsets"] for t in await run_json(service_env, "topics") if t["topic"] == submitted)

    before = await offsets()
    client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=1)
    assert await offsets() > before
    table = (await run(service_env, "topics")).stdout
    for spec in TOPICS.all():
        assert stack.kafka.topic(spec.name) in table


async def test_kns_billing_prices_shows_the_seeded_price_table(stack: Settings, service_env: dict[str, str]) -> None:
    shown = {(p["model"], p["version"]): p for p in await run_json(service_env, "billing", "prices")}
    seed = load_seed()
    assert seed and MODEL in {price.model for price in seed}
    for price in seed:
        row = shown[(price.model, price.version)]
        assert (row["input_per_mtok"], row["cached_input_per_mtok"], row["output_per_mtok"]) == (
            str(price.input_per_mtok), str(price.cached_input_per_mtok), str(price.output_per_mtok))
    table = (await run(service_env, "billing", "prices")).stdout
    assert all(price.version in table for price in seed)


async def test_kns_stack_status_and_logs_show_the_running_infrastructure(stack: Settings,
                                                                        service_env: dict[str, str]) -> None:
    services = {s["service"]: s for s in await run_json(service_env, "stack", "status")}
    for name in ("kafka", "cassandra", "redis"):  # started by `kns stack up --infra-only` before the tests
        assert services[name]["healthy"] and services[name]["pid"], services[name]
    out = await run(service_env, "stack", "logs", "redis", "--lines", "5")
    printed = out.stdout.splitlines()
    log_lines = StackManager(stack).service("redis").log_file.read_text(errors="replace").splitlines()
    assert 0 < len(printed) <= 5 and all(line in log_lines for line in printed), printed
    unknown = await asyncio.to_thread(kns, service_env, "stack", "logs", "no-such-service")
    assert unknown.returncode == 1 and "no-such-service" in unknown.stderr + unknown.stdout
