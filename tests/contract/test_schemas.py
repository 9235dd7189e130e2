"""Each Avro schema and its pydantic twin describe the same event; schemas only evolve compatibly."""

from __future__ import annotations

import enum
import json
import types
import typing
from datetime import UTC, datetime
from pathlib import Path

import pytest
from pydantic import BaseModel

from schemas.codec import AVRO_DIR, SCHEMA_DIRS, codec_for, schema_versions
from schemas.compat import backward_compatible
from schemas.events import (
    AbuseAction,
    AbuseAlert,
    BudgetAlert,
    ChatMessage,
    ChatRequest,
    ControlAction,
    ControlEvent,
    KeyRecord,
    LimitOverrides,
    OrgRecord,
    ReplyTo,
    RequestsRefused,
    SafetyStage,
    SafetyVerdict,
    SamplingSpec,
    StoredCompletion,
    TokenDelta,
    TokenEvent,
    TokenUsage,
    UsageEvent,
)
from schemas.topics import export_json

NOW = datetime(2026, 11, 22, 12, 30, 15, 123000, tzinfo=UTC)

SAMPLES = [
    ChatRequest(
        request_id="chatcmpl-1", created_at=NOW, org_id="org", key_id="key_1", tier="pro", model="m",
        messages=[ChatMessage(role="system", content="be brief"),
                  ChatMessage(role="user", content="héllo ✓", name="u")],
        prompt_token_ids=[1, 2, 49151], sampling=SamplingSpec(max_tokens=5, seed=2**40, stop=["\n\n"]),
        stream=True, reply=ReplyTo(partition=3, gateway_id="gw/1a2b"), conversation_id="conv", user="u1",
        client_addr="10.0.0.1", deadline_at=NOW, store=True, metadata={"ticket": "T-1", "env": "prod"},
    ),
    ChatRequest(
        request_id="chatcmpl-2", created_at=NOW, org_id="org", key_id="k", tier="free", model="m", messages=[],
        prompt_token_ids=[], sampling=SamplingSpec(max_tokens=1, temperature=0.0), stream=False,
        reply=ReplyTo(partition=0, gateway_id="gw"),
    ),
    StoredCompletion(completion_id="chatcmpl-1", org_id="o", key_id="k", user="u1", model="m", created_at=NOW,
                     messages=[ChatMessage(role="user", content="hi")], metadata={"a": "b"}, text="Hello",
                     finish_reason="stop", usage=TokenUsage(prompt_tokens=3, completion_tokens=2, cached_tokens=1)),
    StoredCompletion(completion_id="chatcmpl-2", org_id="o", key_id="k", model="m", created_at=NOW, messages=[],
                     text="", finish_reason="error", usage=TokenUsage(prompt_tokens=0, completion_tokens=0),
                     error="e"),
    TokenEvent(request_id="r", attempt=1, seq=0, token_offset=0, token_ids=[5, 6], text=" Paris", worker_id="w",
               emitted_at_us=1_763_000_000_000_000),
    TokenEvent(request_id="r", attempt=1, seq=1, token_offset=2, token_ids=[7], text=" is", worker_id="w",
               emitted_at_us=1_763_000_000_000_001,
               more=[TokenDelta(request_id="q", attempt=3, seq=4, token_offset=9, token_ids=[8, 9], text="é✓")]),
    TokenEvent(request_id="r", attempt=2, seq=9, token_offset=12, token_ids=[], text="", finish_reason="length",
               usage=TokenUsage(prompt_tokens=37, completion_tokens=12, cached_tokens=16), error="e", worker_id="w",
               emitted_at_us=0, error_code="queue_deadline_exceeded"),
    ControlEvent(request_id="r", action=ControlAction.HALT, reason="unsafe", issued_by="safety", issued_at=NOW),
    UsageEvent(request_id="r", org_id="o", key_id="k", tier="pro", model="m", prompt_tokens=37,
               completion_tokens=8, cached_tokens=0, finish_reason="stop", attempt=1, worker_id="w",
               requested_at=NOW, started_at=NOW, finished_at=NOW, conversation_id=None),
    SafetyVerdict(request_id="r", stage=SafetyStage.POST, blocked=True, category="weapons", score=0.91,
                  classifier="combined/exemplars.v1", org_id=None, key_id="k", at_token=24, decided_at=NOW),
    AbuseAlert(alert_id="a1", key_id="k", org_id="o", tier="free", rule="request_burst", observed=31, threshold=15,
               window_start=NOW, window_s=10, action=AbuseAction.SUSPEND, raised_at=NOW),
    RequestsRefused(key_id="key_1", org_id="acme", tier="free", refused=240, first_at=NOW, last_at=NOW,
                    gateway_id="gw/1a2b"),
    BudgetAlert(alert_id="budget:acme:2026-11:threshold:250000000", org_id="acme", month="2026-11", kind="threshold",
                billed_usd="200.000017", budget_usd="250", alert_fraction=0.8, request_id="r",
                raised_at=NOW),
    OrgRecord(org_id="acme", name="Acme", tier="plus", limits=LimitOverrides(tokens_per_minute=90_000),
              monthly_budget_micros=250_000_000, budget_alert_fraction=0.9, created_at=NOW, updated_at=NOW),
    OrgRecord(org_id="o", name="o", tier="free", created_at=NOW, updated_at=NOW),
    KeyRecord(key_hash="ab" * 32, key_id="key_1", org_id="acme", name="ci", admin=False, models=["m"],
              expires_at=NOW, revoked_at=NOW, created_at=NOW),
    KeyRecord(key_hash="cd" * 32, key_id="key_2", org_id="operators", name="op", admin=True, created_at=NOW),
]


@pytest.mark.parametrize("event", SAMPLES, ids=lambda e: type(e).__name__)
def test_every_event_round_trips_through_its_schema(event: BaseModel) -> None:
    codec = codec_for(type(event))
    assert codec.decode(codec.encode(event)) == event


_AVRO_OF = {str: "string", int: ("int", "long"), float: ("double", "float"), bool: "boolean",
            datetime: "long"}


def _avro_type_matches(annotation: object, avro: object, named: dict[str, dict]) -> bool:  # type: ignore[type-arg]
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if not isinstance(avro, list) or "null" not in avro:
            return False
        inner = [a for a in args if a is not type(None)]
        rest = [a for a in avro if a != "null"]
        return len(inner) == 1 and len(rest) == 1 and _avro_type_matches(inner[0], rest[0], named)
    if isinstance(avro, str) and avro in named:
        avro = named[avro]
    if origin is list:
        return isinstance(avro, dict) and avro["type"] == "array" and _avro_type_matches(args[0], avro["items"], named)
    if origin is dict:
        return (isinstance(avro, dict) and avro["type"] == "map" and args[0] is str
                and _avro_type_matches(args[1], avro["values"], named))
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return isinstance(avro, dict) and avro["type"] == "record" and _fields_match(annotation, avro, named) == []
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        symbols = {a.value for a in annotation}
        return isinstance(avro, dict) and avro["type"] == "enum" and set(avro["symbols"]) == symbols
    expected = _AVRO_OF[annotation]  # type: ignore[index]
    actual = avro["type"] if isinstance(avro, dict) else avro
    if annotation is datetime:
        return isinstance(avro, dict) and avro.get("logicalType", "").startswith("timestamp")
    return actual in (expected if isinstance(expected, tuple) else (expected,))


def _fields_match(model: type[BaseModel], record: dict, named: dict[str, dict]) -> list[str]:  # type: ignore[type-arg]
    named[record["name"]] = record
    problems = []
    avro_fields = {f["name"]: f for f in record["fields"]}
    if set(avro_fields) != set(model.model_fields):
        problems.append(f"{model.__name__}: fields differ: {set(avro_fields) ^ set(model.model_fields)}")
    for name, info in model.model_fields.items():
        if name not in avro_fields:
            continue
        avro_field = avro_fields[name]
        if not _avro_type_matches(info.annotation, avro_field["type"], named):
            problems.append(f"{model.__name__}.{name}: {info.annotation} vs {avro_field['type']}")
        optional_in_avro = "default" in avro_field
        if optional_in_avro and info.is_required():
            problems.append(f"{model.__name__}.{name}: has an Avro default but is required in pydantic")
    return problems


@pytest.mark.parametrize("model", list(SCHEMA_DIRS), ids=lambda m: m.__name__)
def test_pydantic_model_matches_newest_avro_schema(model: type[BaseModel]) -> None:
    newest = schema_versions(SCHEMA_DIRS[model])[-1]
    assert newest.raw["name"] == model.__name__
    assert _fields_match(model, newest.raw, {}) == []


@pytest.mark.parametrize("folder", sorted(SCHEMA_DIRS.values()))
def test_every_released_version_is_readable_by_the_newest(folder: str) -> None:
    versions = schema_versions(folder)
    assert [v.version for v in versions] == list(range(1, len(versions) + 1)), "versions must be v1, v2, ..."
    for old in versions:
        ok, why = backward_compatible(old.raw, versions[-1].raw)
        assert ok, f"{old.label} → {versions[-1].label}: {why}"


def test_compatibility_check_rejects_a_breaking_change() -> None:
    old = json.loads((AVRO_DIR / "usage_event" / "v1.avsc").read_text())
    breaking = json.loads(json.dumps(old))
    breaking["fields"].append({"name": "price_micros", "type": "long"})  # no default: old data cannot fill it
    assert backward_compatible(old, breaking)[0] is False
    compatible = json.loads(json.dumps(old))
    compatible["fields"].append({"name": "price_micros", "type": ["null", "long"], "default": None})
    assert backward_compatible(old, compatible) == (True, "")


def test_every_schema_file_is_registered() -> None:
    on_disk = {p.name for p in AVRO_DIR.iterdir() if p.is_dir()}
    assert on_disk == set(SCHEMA_DIRS.values())


def test_terraform_topic_file_is_current() -> None:
    path = Path(__file__).resolve().parents[2] / "infra" / "terraform" / "topics.json"
    assert path.read_text() == export_json(), "run: python -m schemas.topics > infra/terraform/topics.json"


def _sample(schema: object, named: dict[str, object]) -> object:
    """A value of an Avro type, every optional branch filled (nothing left to a default)."""
    if isinstance(schema, str):
        primitives: dict[str, object] = {"string": "s", "int": 7, "long": 7, "double": 1.5, "float": 1.5,
                                         "boolean": True, "bytes": b"b", "null": None}
        return primitives[schema] if schema in primitives else _sample(named[schema], named)
    if isinstance(schema, list):
        return _sample(next(s for s in schema if s != "null"), named)
    assert isinstance(schema, dict)
    kind = schema["type"]
    if schema.get("logicalType") == "timestamp-millis":
        return datetime(2026, 11, 27, 12, 30, tzinfo=UTC)
    if kind == "record":
        named[schema["name"]] = schema
        return {f["name"]: _sample(f["type"], named) for f in schema["fields"]}
    if kind == "enum":
        named[schema["name"]] = schema
        return schema["symbols"][0]
    if kind == "array":
        return [_sample(schema["items"], named)]
    if kind == "map":
        return {"k": _sample(schema["values"], named)}
    return _sample(kind, named)


@pytest.mark.parametrize("model", list(SCHEMA_DIRS), ids=lambda m: m.__name__)
def test_bytes_written_with_every_released_version_decode_with_the_newest_reader(model: type[BaseModel]) -> None:
    """Not the project's own compatibility checker: a record written with each released schema (every field set)
    is decoded by the codec the services use, into the newest model. A field both versions have keeps its value;
    a field the old version lacks takes the newest schema's default."""
    codec = codec_for(model)
    versions = schema_versions(SCHEMA_DIRS[model])
    newest_fields = {f["name"]: f for f in versions[-1].raw["fields"]}
    for old in versions:
        written = _sample(old.raw, {})
        assert isinstance(written, dict)
        data = codec.encode_dict(written, version=old.version)
        assert data[2:10] == old.fingerprint, f"{old.label}: not written with that version"
        decoded = codec.decode_dict(data)
        for name, field in newest_fields.items():
            old_field = next((f for f in old.raw["fields"] if f["name"] == name), None)
            if old_field is None:
                assert decoded[name] == field["default"], f"{old.label} → newest: {name}"
            elif old_field["type"] == field["type"]:
                assert decoded[name] == written[name], f"{old.label} → newest: {name}"
        codec.model.model_validate(decoded)  # the services' next step
