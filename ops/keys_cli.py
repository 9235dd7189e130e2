"""``kns orgs`` and ``kns keys``: the tenancy admin from a shell (the same use cases as the admin HTTP API). A
secret is printed once; only its hash is stored."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import datetime
from decimal import Decimal, InvalidOperation
from typing import Any, TypeVar, cast

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from producers.gateway.routes.admin import key_json, org_json
from producers.tenancy.admin import (
    MICROS,
    OPERATORS_ORG,
    IssuedKey,
    KeyCreate,
    KeyRotate,
    OrgCreate,
    OrgUpdate,
    TenancyAdmin,
    TenancyError,
    open_admin,
)
from runtime.cassandra_client import connect_async
from runtime.cli_tables import emit_json, show
from runtime.redis_client import make_redis
from runtime.settings import load_settings
from runtime.suspensions import KeySuspensions
from schemas.events import KeyRecord, OrgRecord

app = typer.Typer(help="API keys.", no_args_is_help=True)
orgs_app = typer.Typer(help="Organizations: tier, limits, budget.", no_args_is_help=True)
console = Console()
T = TypeVar("T")
#: ``--json``: what the command shows, as the admin API answers it
JSON = typer.Option(False, "--json", help="Print JSON (the admin API's shape) instead of a table, for scripts.")


def _run(use: Callable[[TenancyAdmin], Awaitable[T]]) -> T:
    async def go() -> T:
        async with open_admin(load_settings()) as admin:
            return await use(admin)

    try:
        return asyncio.run(go())
    except TenancyError as exc:
        console.print(f"[red]error ({exc.code}):[/red] {exc.message}")
        raise typer.Exit(2) from exc
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        console.print(f"[red]invalid input:[/red] {problems}")
        raise typer.Exit(2) from exc
    except InvalidOperation as exc:
        console.print("[red]invalid input:[/red] --budget-usd must be a number of dollars")
        raise typer.Exit(2) from exc


def _org_table(orgs: list[OrgRecord]) -> Table:
    table = Table(title="organizations")
    for column in ("org_id", "name", "tier", "rpm", "tpm", "concurrent", "budget USD/month"):
        table.add_column(column)
    for org in orgs:
        budget = "-" if org.monthly_budget_micros is None else str(org.monthly_budget_micros / MICROS)
        limits = org.limits
        table.add_row(org.org_id, org.name, org.tier, *(str(v) if v is not None else "tier" for v in
                      (limits.requests_per_minute, limits.tokens_per_minute, limits.max_concurrent)), budget)
    return table


def _key_table(keys: list[KeyRecord]) -> Table:
    table = Table(title="API keys")
    for column in ("key_id", "org_id", "name", "models", "expires", "revoked", "created"):
        table.add_column(column, overflow="fold" if column == "models" else "ellipsis")
    for key in keys:
        table.add_row(key.key_id, key.org_id, key.name, ", ".join(key.models) or "all",
                      str(key.expires_at or "-"), str(key.revoked_at or "-"), str(key.created_at))
    return table


def _print_orgs(orgs: list[OrgRecord], as_json: bool) -> None:
    if as_json:
        emit_json([org_json(org) for org in orgs])
    else:
        show(console, _org_table(orgs))


def _print_keys(keys: list[KeyRecord], as_json: bool) -> None:
    if as_json:
        emit_json([key_json(key) for key in keys])
    else:
        show(console, _key_table(keys))


def _print_issued(issued: IssuedKey) -> None:
    key = issued.record
    console.print(f"key_id={key.key_id} org={key.org_id}" + (" admin" if key.admin else ""))
    console.print(issued.secret)


@orgs_app.command("create")
def create_org(
    org_id: str = typer.Argument(..., help="The org's id (lowercase letters, digits, - and _)."),
    tier: str = typer.Option("free", help="Service tier (free, plus, enterprise)."),
    name: str = typer.Option("", help="A label for humans."),
    rpm: int | None = typer.Option(None, help="Requests per minute, instead of the tier's."),
    tpm: int | None = typer.Option(None, help="Tokens per minute, instead of the tier's."),
    concurrent: int | None = typer.Option(None, help="Requests in flight at once, instead of the tier's."),
    budget_usd: str | None = typer.Option(None, help="Monthly budget in USD."),
    as_json: bool = JSON,
) -> None:
    """Create an organization."""
    def spec() -> OrgCreate:
        return OrgCreate.model_validate({
            "org_id": org_id, "tier": tier, "name": name,
            "limits": {"requests_per_minute": rpm, "tokens_per_minute": tpm, "max_concurrent": concurrent},
            "monthly_budget_usd": None if budget_usd is None else Decimal(budget_usd)})

    org = _run(lambda admin: admin.create_org(spec()))
    _print_orgs([org], as_json)


def _limit(value: str | None, option: str) -> int | None:
    """A limit option of ``orgs update``: a number, or 'tier' (back to the tier's)."""
    if value is None or value == "tier":
        return None
    try:
        return int(value)
    except ValueError:
        raise typer.BadParameter("a whole number, or 'tier' for the tier's limit", param_hint=option) from None


@orgs_app.command("update")
def update_org(
    org_id: str = typer.Argument(...),
    tier: str | None = typer.Option(None, help="A new tier."),
    name: str | None = typer.Option(None, help="A new label for humans."),
    rpm: str | None = typer.Option(None, help="Requests per minute, instead of the tier's ('tier': the tier's)."),
    tpm: str | None = typer.Option(None, help="Tokens per minute, instead of the tier's ('tier': the tier's)."),
    concurrent: str | None = typer.Option(None, help="Requests in flight at once, instead of the tier's ('tier': "
                                                     "the tier's)."),
    budget_usd: str | None = typer.Option(None, help="A new monthly budget in USD ('none' removes it)."),
    as_json: bool = JSON,
) -> None:
    """Change what create set: tier, name, limits or budget (on every gateway within a second). Only the options
    given change."""
    limits = {field: _limit(value, option) for field, option, value in (
        ("requests_per_minute", "--rpm", rpm), ("tokens_per_minute", "--tpm", tpm),
        ("max_concurrent", "--concurrent", concurrent)) if value is not None}

    def change() -> OrgUpdate:
        fields: dict[str, object] = {"tier": tier} if tier else {}
        if name is not None:
            fields["name"] = name
        if limits:
            fields["limits"] = limits
        if budget_usd is not None:
            fields["monthly_budget_usd"] = None if budget_usd == "none" else Decimal(budget_usd)
        return OrgUpdate.model_validate(fields)

    org = _run(lambda admin: admin.update_org(org_id, change()))
    _print_orgs([org], as_json)


@orgs_app.command("list")
def list_orgs(as_json: bool = JSON) -> None:
    """List organizations."""
    async def go(admin: TenancyAdmin) -> list[OrgRecord]:
        return admin.orgs()
    _print_orgs(_run(go), as_json)


@app.command()
def create(
    org: str = typer.Option(..., help="Organisation the key bills to (created on --tier when missing)."),
    tier: str = typer.Option("free", help="Tier of a new org (free, plus, enterprise)."),
    name: str = typer.Option("", help="A label for humans."),
    model: list[str] = typer.Option([], help="A model the key may use (repeat; none: every model)."),
    expires: datetime | None = typer.Option(None, help="When the key stops working (ISO 8601, UTC)."),
) -> None:
    """Create a key and print its secret (shown once)."""
    _print_issued(_run(lambda admin: admin.issue_key(org, tier, KeyCreate(name=name, models=model,
                                                                             expires_at=expires))))


@app.command("create-admin")
def create_admin(name: str = typer.Option("operator", help="A label for humans.")) -> None:
    """Create a platform operator key (an admin key of the operators org: it administers every org, on the admin
    HTTP API only) and print its secret (shown once). The HTTP API never makes one."""
    _print_issued(_run(lambda admin: admin.issue_key(OPERATORS_ORG, "enterprise", KeyCreate(name=name, admin=True))))


@app.command("list")
def list_keys(org: str = typer.Option(..., help="The organisation whose keys to list."),
              as_json: bool = JSON) -> None:
    """List an org's keys (never their secrets)."""
    async def go(admin: TenancyAdmin) -> list[KeyRecord]:
        return admin.keys(org)
    _print_keys(_run(go), as_json)


@app.command()
def rotate(key_id: str = typer.Argument(...),
           grace_s: int = typer.Option(0, help="How long the old secret keeps working.")) -> None:
    """A new secret for a key; the old one stops after the grace period."""
    _print_issued(_run(lambda admin: admin.rotate_key(key_id, KeyRotate(grace_s=grace_s))))


@app.command()
def revoke(key_id: str = typer.Argument(...), as_json: bool = JSON) -> None:
    """Revoke a key: 401 on every gateway within a second."""
    key = _run(lambda admin: admin.revoke_key(key_id))
    _print_keys([key], as_json)


async def _suspensions(action: str, key_id: str | None = None) -> object:
    settings = load_settings()
    cluster, session = await connect_async(settings.cassandra)
    redis = make_redis(settings.redis)
    try:
        suspensions = await KeySuspensions.open(session, settings.cassandra.keyspace, redis, settings.redis)
        if action == "lift":
            assert key_id is not None
            return await suspensions.lift(key_id)
        return await suspensions.all()
    finally:
        await redis.aclose()
        await asyncio.to_thread(cluster.shutdown)


@app.command()
def unsuspend(key_id: str = typer.Argument(..., help="The key_id of a suspended key.")) -> None:
    """Lift a suspension imposed by the abuse detector: the key works again at once."""
    lifted = asyncio.run(_suspensions("lift", key_id))
    console.print(f"{key_id}: " + ("suspension lifted" if lifted else "was not suspended"))


@app.command()
def suspended(as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table, for scripts.")
              ) -> None:
    """List suspended keys and why."""
    rows = cast(list[dict[str, Any]], asyncio.run(_suspensions("list")))
    if as_json:
        emit_json(rows)
    else:
        show(console, suspended_table(rows))


def suspended_table(rows: list[dict[str, Any]]) -> Table:
    table = Table(title="suspended keys")
    for column in ("key_id", "org_id"):
        table.add_column(column)
    table.add_column("reason", overflow="fold")
    for column in ("alert_id", "since"):
        table.add_column(column)
    for row in rows:
        table.add_row(row["key_id"], row["org_id"], row["reason"], row["alert_id"], str(row["suspended_at"]))
    return table
