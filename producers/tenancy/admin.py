"""The tenancy use cases: create, list, update orgs; issue, list, rotate and revoke keys. The admin HTTP API and
``kns orgs`` / ``kns keys`` are thin adapters over ``TenancyAdmin``.

Each use case acts within a :class:`Scope`. A platform operator (an admin key of the operators org, or the CLI)
administers every org. An admin key of any other org is that org's admin: it sees and changes its own org alone
(another org, or a key of another org, is not found, as another tenant's objects are not found anywhere else), may
set its limits up to its tier's (never raise them past both the tier's and what it has), and may not change its
tier or create orgs. Platform operator keys are made by the CLI alone, never over HTTP.

Each change is a Kafka transaction of records on the compacted registry topics, the record of truth (as a schema
registry keeps its schemas). Changes are serialised across every process by one transactional id: a change starts
its producer with that id, which fences any change still open elsewhere (that one fails with 409
``concurrent_change``), then catches its view up to the topics' end, checks, writes, commits, and answers once its
own view has applied the records. So a check never reads a state older than the last committed change, a rotation
and a revocation of one key cannot interleave, and every change is visible to whoever made it at once and to every
gateway within its fetch latency.
"""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal

from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaError, ProducerFenced
from aiokafka.structs import RecordMetadata
from pydantic import BaseModel, ConfigDict, Field, field_validator

from producers.gateway.keys import hash_key, new_secret
from runtime.kafka_clients import make_producer
from runtime.settings import KafkaSettings, Settings, TierPolicy
from runtime.tenancy import TenancyView
from schemas.codec import codec_for
from schemas.events import Event, KeyRecord, LimitOverrides, OrgRecord, utcnow
from schemas.topics import TOPICS

log = logging.getLogger(__name__)

ORG_ID = re.compile(r"[a-z0-9][a-z0-9_-]{1,62}")
INT_MAX = 2**31 - 1
REGISTRY_TXN_ID = "tenancy-registry"
MICROS = Decimal(1_000_000)
MAX_GRACE_S = 7 * 24 * 3600
APPLY_TIMEOUT_S = 10.0


class TenancyError(Exception):
    def __init__(self, status: int, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param


def _not_found(what: str, ident: str) -> TenancyError:
    return TenancyError(404, f"No {what} with id '{ident}'.", f"{what.replace(' ', '_')}_not_found")


def _forbidden(message: str, param: str | None = None) -> TenancyError:
    return TenancyError(403, message, "insufficient_permissions", param=param)


#: the org operators' admin keys belong to
OPERATORS_ORG = "operators"


@dataclass(frozen=True)
class Scope:
    """Whom a use case acts for (see the module's docstring)."""

    #: the one org it administers; None: every org (a platform operator)
    org_id: str | None = None
    #: may issue admin keys of the operators org (platform operator keys): the CLI only, never the HTTP API
    mints_operators: bool = False

    @property
    def operator(self) -> bool:
        return self.org_id is None

    def sees(self, org_id: str) -> bool:
        return self.org_id is None or self.org_id == org_id


#: the CLI and the operators' tools (provisioning, benches, tests)
PLATFORM = Scope(mints_operators=True)


def scope_of(admin_key: KeyRecord) -> Scope:
    """An admin key's scope over HTTP: a platform operator's for the operators org's keys, else its own org's."""
    return Scope() if admin_key.org_id == OPERATORS_ORG else Scope(org_id=admin_key.org_id)


class _Input(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


#: the largest limit the rate limiter counts exactly (its Lua numbers are doubles)
LIMIT_MAX = 2**53
#: the largest monthly budget admission compares exactly (2**53 nano-dollars, runtime/spend.py)
BUDGET_MAX_USD = Decimal(9_000_000)


class Limits(_Input):
    requests_per_minute: int | None = Field(default=None, ge=1, le=LIMIT_MAX)
    tokens_per_minute: int | None = Field(default=None, ge=1, le=LIMIT_MAX)
    max_concurrent: int | None = Field(default=None, ge=1, le=INT_MAX)


class OrgCreate(_Input):
    org_id: str
    name: str = Field(default="", max_length=200)
    tier: str
    limits: Limits = Field(default_factory=Limits)
    monthly_budget_usd: Decimal | None = Field(default=None, ge=0, le=BUDGET_MAX_USD, decimal_places=6)
    budget_alert_fraction: float = Field(default=0.8, gt=0, le=1)

    @field_validator("org_id")
    @classmethod
    def _org_id(cls, value: str) -> str:
        if not ORG_ID.fullmatch(value):
            raise ValueError("2-63 characters: lowercase letters, digits, '-' and '_', starting with a letter or digit")
        return value


class OrgUpdate(_Input):
    """Only the fields given change; ``monthly_budget_usd: null`` removes the budget."""

    name: str | None = Field(default=None, max_length=200)
    tier: str | None = None
    limits: Limits | None = None
    monthly_budget_usd: Decimal | None = Field(default=None, ge=0, le=BUDGET_MAX_USD, decimal_places=6)
    budget_alert_fraction: float | None = Field(default=None, gt=0, le=1)


class KeyCreate(_Input):
    name: str = Field(default="", max_length=200)
    models: list[str] = Field(default_factory=list, max_length=100)
    #: a time without a zone is UTC
    expires_at: datetime | None = None
    admin: bool = False

    @field_validator("expires_at")
    @classmethod
    def _utc(cls, value: datetime | None) -> datetime | None:
        return value.replace(tzinfo=UTC) if value is not None and value.tzinfo is None else value

    @field_validator("models")
    @classmethod
    def _models(cls, value: list[str]) -> list[str]:
        if any(not m.strip() for m in value):
            raise ValueError("model names must not be empty")
        return value


class KeyRotate(_Input):
    #: how long the old secret keeps working (0: it stops at once)
    grace_s: int = Field(default=0, ge=0, le=MAX_GRACE_S)


@dataclass(frozen=True)
class IssuedKey:
    secret: str  # shown once
    record: KeyRecord


class RegistryWriter:
    """Serialised, atomic changes to the registry topics (see the module's docstring)."""

    def __init__(self, kafka: KafkaSettings, view: TenancyView) -> None:
        self._kafka = kafka
        self._view = view
        self._org_topic = kafka.topic(TOPICS.orgs.name)
        self._key_topic = kafka.topic(TOPICS.keys.name)

    def _encoded(self, record: Event) -> tuple[str, bytes, bytes]:
        if isinstance(record, OrgRecord):
            return self._org_topic, record.org_id.encode(), codec_for(OrgRecord).encode(record)
        if isinstance(record, KeyRecord):
            return self._key_topic, record.key_hash.encode(), codec_for(KeyRecord).encode(record)
        raise TypeError(type(record).__name__)

    @asynccontextmanager
    async def change(self) -> AsyncIterator[list[Event]]:
        """Inside: the view is current (no other change can commit meanwhile); append the records to write."""
        producer = make_producer(self._kafka, role="tenancy-admin", transactional_id=REGISTRY_TXN_ID)
        try:
            await producer.start()
        except KafkaError as exc:
            await _stop_quietly(producer)
            raise _unavailable() from exc
        written: dict[TopicPartition, int] = {}
        try:
            if not await self._view.catch_up():
                raise _unavailable()
            records: list[Event] = []
            yield records
            if records:
                written = await self._commit(producer, records)
        finally:
            await _stop_quietly(producer)
        try:
            await asyncio.wait_for(self._view.reached(written), APPLY_TIMEOUT_S)
        except TimeoutError:
            # Committed: the answer stands; only this process's own reads lag behind it for a moment.
            log.warning("registry change committed but not yet applied here", extra={"records": len(written)})

    async def _commit(self, producer: AIOKafkaProducer, records: list[Event]) -> dict[TopicPartition, int]:
        sent: list[asyncio.Future[RecordMetadata]] = []
        try:
            async with producer.transaction():
                for record in records:
                    sent.append(await producer.send(*self._topic_value_key(record)))
            metas = [await future for future in sent]
        except ProducerFenced as exc:
            _retrieve(sent)
            raise TenancyError(409, "Another change to the registry was made at the same moment and won; retry.",
                               "concurrent_change") from exc
        except KafkaError as exc:
            _retrieve(sent)
            raise TenancyError(503, "The registry could not be written; nothing changed, or it did if reading it "
                               "back shows the change. Retry.", "registry_unavailable") from exc
        written: dict[TopicPartition, int] = {}
        for meta in metas:
            tp = TopicPartition(meta.topic, meta.partition)
            written[tp] = max(written.get(tp, 0), meta.offset + 1)
        return written

    def _topic_value_key(self, record: Event) -> tuple[str, bytes, bytes]:
        topic, key, value = self._encoded(record)
        return topic, value, key


def _retrieve(futures: list[asyncio.Future[RecordMetadata]]) -> None:
    """The sends of an aborted transaction fail too: their errors are the transaction's, already handled."""
    for future in futures:
        if future.done() and not future.cancelled():
            future.exception()


def _unavailable() -> TenancyError:
    return TenancyError(503, "The registry is unreachable (Kafka); nothing changed. Retry shortly.",
                        "registry_unavailable")


async def _stop_quietly(producer: AIOKafkaProducer) -> None:
    try:
        await asyncio.wait_for(producer.stop(), 10)
    except Exception:  # a fenced producer may not stop cleanly; it is abandoned either way
        log.debug("tenancy admin producer did not stop cleanly", exc_info=True)


def _micros(usd: Decimal | None) -> int | None:
    return None if usd is None else int(usd * MICROS)


def _overrides(limits: Limits) -> LimitOverrides:
    return LimitOverrides(**limits.model_dump())


class TenancyAdmin:
    def __init__(self, view: TenancyView, writer: RegistryWriter, tiers: Mapping[str, TierPolicy]) -> None:
        self.view = view
        self._writer = writer
        self._tiers = dict(tiers)

    # --- orgs -----------------------------------------------------------------------------------------

    def _check_tier(self, tier: str) -> None:
        if tier not in self._tiers:
            raise TenancyError(400, f"Unknown tier '{tier}': one of {', '.join(self._tiers)}.", "unknown_tier",
                               param="tier")

    def org(self, org_id: str, scope: Scope = PLATFORM) -> OrgRecord:
        org = self.view.orgs.get(org_id) if scope.sees(org_id) else None
        if org is None:
            raise _not_found("organization", org_id)
        return org

    def orgs(self, scope: Scope = PLATFORM) -> list[OrgRecord]:
        return sorted((o for o in self.view.orgs.values() if scope.sees(o.org_id)), key=lambda o: o.org_id)

    async def create_org(self, spec: OrgCreate, scope: Scope = PLATFORM) -> OrgRecord:
        if not scope.operator:
            raise _forbidden("Only a platform operator creates organizations.")
        self._check_tier(spec.tier)
        async with self._writer.change() as records:
            if spec.org_id in self.view.orgs:
                raise TenancyError(409, f"Organization '{spec.org_id}' already exists.", "organization_exists",
                                   param="org_id")
            now = utcnow()
            org = OrgRecord(org_id=spec.org_id, name=spec.name or spec.org_id, tier=spec.tier,
                            limits=_overrides(spec.limits), monthly_budget_micros=_micros(spec.monthly_budget_usd),
                            budget_alert_fraction=spec.budget_alert_fraction, created_at=now, updated_at=now)
            records.append(org)
        return org

    async def update_org(self, org_id: str, change: OrgUpdate, scope: Scope = PLATFORM) -> OrgRecord:
        if change.tier is not None:
            self._check_tier(change.tier)
        given = change.model_fields_set
        async with self._writer.change() as records:
            org = self.org(org_id, scope)
            if not scope.operator:
                self._check_org_admins_change(org, change)
            limits = org.limits
            if change.limits is not None:  # only the limits given change; null: back to the tier's
                limits = limits.model_copy(update={f: getattr(change.limits, f)
                                                   for f in change.limits.model_fields_set})
            updated = org.model_copy(update={
                "name": change.name if change.name is not None else org.name,
                "tier": change.tier or org.tier,
                "limits": limits,
                "monthly_budget_micros": (_micros(change.monthly_budget_usd) if "monthly_budget_usd" in given
                                          else org.monthly_budget_micros),
                "budget_alert_fraction": change.budget_alert_fraction or org.budget_alert_fraction,
                "updated_at": utcnow(),
            })
            records.append(updated)
        return updated

    def _check_org_admins_change(self, org: OrgRecord, change: OrgUpdate) -> None:
        """An org admin keeps its tier, and sets each limit up to its tier's (or lowers it from what it has)."""
        if change.tier is not None and change.tier != org.tier:
            raise _forbidden("An org admin cannot change its organization's tier; a platform operator can.",
                             param="tier")
        if change.limits is None:
            return
        policy = self._tiers[org.tier] if org.tier in self._tiers else next(iter(self._tiers.values()))
        for field in change.limits.model_fields_set:
            tiers = getattr(policy, field)
            wanted = getattr(change.limits, field) or tiers
            has = getattr(org.limits, field) or tiers
            if wanted > max(tiers, has):
                raise _forbidden(f"{field} {wanted} is above the {org.tier} tier's {tiers}: an org admin sets its "
                                 "limits up to its tier's; a platform operator can grant more.",
                                 param=f"limits.{field}")

    # --- keys -----------------------------------------------------------------------------------------

    def keys(self, org_id: str, scope: Scope = PLATFORM) -> list[KeyRecord]:
        self.org(org_id, scope)
        return self.view.keys_of_org(org_id)

    def key(self, key_id: str, scope: Scope = PLATFORM) -> KeyRecord:
        records = self.view.keys_of(key_id)
        if not records or not scope.sees(records[0].org_id):
            raise _not_found("api key", key_id)
        return records[0]

    async def create_key(self, org_id: str, spec: KeyCreate, scope: Scope = PLATFORM) -> IssuedKey:
        if spec.expires_at is not None and spec.expires_at <= utcnow():
            raise TenancyError(400, "expires_at must be in the future.", "invalid_expiry", param="expires_at")
        secret = new_secret()
        async with self._writer.change() as records:
            self.org(org_id, scope)
            if spec.admin and org_id == OPERATORS_ORG and not scope.mints_operators:
                raise _forbidden("Platform operator keys are made with the CLI (`kns keys create-admin`), never "
                                 "over HTTP.", param="admin")
            record = KeyRecord(key_hash=hash_key(secret), key_id="key_" + secrets.token_hex(8), org_id=org_id,
                               name=spec.name, admin=spec.admin, models=spec.models, expires_at=spec.expires_at,
                               created_at=utcnow())
            records.append(record)
        return IssuedKey(secret, record)

    async def rotate_key(self, key_id: str, spec: KeyRotate, scope: Scope = PLATFORM) -> IssuedKey:
        """A new secret for the same key (same id, org, models, expiry); the old secrets stop after the grace."""
        secret = new_secret()
        async with self._writer.change() as records:
            current = self.key(key_id, scope)
            now = utcnow()
            if not current.usable_at(now):
                raise TenancyError(409, f"API key '{key_id}' is revoked or expired.", "api_key_not_usable")
            record = current.model_copy(update={"key_hash": hash_key(secret), "created_at": now, "revoked_at": None})
            ends = now + timedelta(seconds=spec.grace_s)
            records.append(record)
            records += [old.model_copy(update={"revoked_at": ends}) for old in self.view.keys_of(key_id)
                        if old.revoked_at is None or old.revoked_at > ends]
        return IssuedKey(secret, record)

    async def revoke_key(self, key_id: str, scope: Scope = PLATFORM) -> KeyRecord:
        """Every secret of the key stops working, on every gateway, within the fetch latency. Idempotent."""
        async with self._writer.change() as records:
            self.key(key_id, scope)
            now = utcnow()
            records += [r.model_copy(update={"revoked_at": now}) for r in self.view.keys_of(key_id)
                        if r.revoked_at is None or r.revoked_at > now]
        return self.key(key_id)

    # --- for operators' tools and tests -----------------------------------------------------------------

    async def ensure_org(self, org_id: str, tier: str, limits: Limits | None = None) -> OrgRecord:
        """The org, created on the given tier when it does not exist (an existing org keeps its own tier). With
        ``limits``, the org has those overrides afterwards (a bench or test org that needs more than its tier's)."""
        await self.view.catch_up()
        existing = self.view.orgs.get(org_id)
        if existing is None:
            try:
                existing = await self.create_org(OrgCreate(org_id=org_id, tier=tier, limits=limits or Limits()))
            except TenancyError as exc:
                if exc.code != "organization_exists":
                    raise
                existing = self.org(org_id)
        if limits is not None and existing.limits != _overrides(limits):
            existing = await self.update_org(org_id, OrgUpdate(limits=limits))
        return existing

    async def issue_key(self, org_id: str, tier: str, spec: KeyCreate | None = None, *,
                        limits: Limits | None = None) -> IssuedKey:
        await self.ensure_org(org_id, tier, limits)
        return await self.create_key(org_id, spec or KeyCreate())

    async def register_secret(self, org_id: str, tier: str, secret: str, *, key_id: str, name: str,
                              admin: bool = False) -> bool:
        """Make a secret kept elsewhere (the dev key file) a key of ``org_id``, unless the registry knows it
        already (a revoked secret stays revoked). True when it was registered now."""
        await self.ensure_org(org_id, tier)
        async with self._writer.change() as records:
            if hash_key(secret) in self.view.keys:
                return False
            records.append(KeyRecord(key_hash=hash_key(secret), key_id=key_id, org_id=org_id, name=name,
                                     admin=admin, created_at=utcnow()))
        return True


#: limits no load a benchmark or a test sends reaches: for orgs that measure or test something else
UNLIMITED = Limits(requests_per_minute=10**9, tokens_per_minute=10**12, max_concurrent=10**6)


@asynccontextmanager
async def open_admin(settings: Settings) -> AsyncIterator[TenancyAdmin]:
    """A TenancyAdmin with a view of its own (read to the end), for CLIs, provisioning and tests."""
    view = TenancyView(settings.kafka, catch_up_timeout_s=settings.tenancy.catch_up_timeout_s)
    try:
        await view.start()
        yield TenancyAdmin(view, RegistryWriter(settings.kafka, view), settings.tenancy.tiers.policies())
    finally:
        await view.stop()
