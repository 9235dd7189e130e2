"""``--json`` of every operator command that prints a table, on the real Kafka, Cassandra and Redis: stdout is one
JSON document (progress and notes go to stderr) and it says what the table says."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from typer.testing import CliRunner

from ops.cli import app
from runtime.settings import Settings
from schemas.topics import TOPICS

pytestmark = pytest.mark.integration


def kns_json(*args: str, exit_code: int = 0) -> Any:
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == exit_code, result.output
    return json.loads(result.stdout)


def test_orgs_and_keys_json_is_the_admin_apis_shape(stack: Settings, make_caller) -> None:  # type: ignore[no-untyped-def]
    org = f"org-json-{uuid.uuid4().hex[:8]}"
    (created,) = kns_json("orgs", "create", org, "--tier", "plus", "--rpm", "90", "--budget-usd", "12.5")
    assert created["object"] == "organization" and created["id"] == org
    assert created["limits"]["requests_per_minute"] == 90 and created["monthly_budget_usd"] == "12.5"
    assert org in [o["id"] for o in kns_json("orgs", "list")]
    (updated,) = kns_json("orgs", "update", org, "--budget-usd", "none")
    assert updated["monthly_budget_usd"] is None
    key_id = make_caller(org=org, tier="plus").key.key_id
    (listed,) = kns_json("keys", "list", "--org", org)
    assert listed["id"] == key_id and listed["revoked_at"] is None and "value" not in listed
    (revoked,) = kns_json("keys", "revoke", key_id)
    assert revoked["id"] == key_id and revoked["revoked_at"] is not None
    assert isinstance(kns_json("keys", "suspended"), list)


def test_topics_and_tokens_json(stack: Settings) -> None:
    topics = kns_json("topics")
    assert [t["topic"] for t in topics] == [stack.kafka.topic(spec.name) for spec in TOPICS.all()]
    assert all(isinstance(t["offsets"], int) for t in topics)
    assert isinstance(kns_json("tokens", "--since", "60"), list)


def test_billing_json(stack: Settings) -> None:
    prices = kns_json("billing", "prices")
    assert prices and {"model", "valid_from", "version", "input_per_mtok", "output_per_mtok"} <= prices[0].keys()
    org = f"org-json-{uuid.uuid4().hex[:8]}"
    spend = kns_json("billing", "spend", org)
    assert spend["org_id"] == org and spend["agrees"] and spend["redis"]["billed_usd"] == spend["ledger_usd"]
    end = datetime.now(UTC)
    report = kns_json("billing", "reconcile", "--org", org, "--start", (end - timedelta(minutes=5)).isoformat(),
                      "--end", end.isoformat())
    assert report["clean"] and report["rows"] == [] and report["discrepancies"] == []


def test_conversations_purge_and_stack_status_json(stack: Settings) -> None:
    purge = kns_json("conversations", "purge", "--after-days", "30")
    assert isinstance(purge["purged"], int) and purge["deleted_before"]
    services = {s["service"]: s for s in kns_json("stack", "status")}
    assert {"kafka", "cassandra", "redis", "gateway", "worker"} <= services.keys()
