"""Avro single-object encoding of the platform's events.

A record is ``C3 01`` + the writer schema's CRC-64-AVRO fingerprint (8 bytes, little-endian) + the Avro
binary body. Readers look the fingerprint up among every released version of the event's schema (all kept in
``schemas/avro/<event>/v<n>.avsc``) and resolve it to the newest version, so old records stay readable.
"""

from __future__ import annotations

import io
import json
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, Generic, TypeVar

from fastavro import parse_schema, schemaless_reader, schemaless_writer
from fastavro.schema import fingerprint, to_parsing_canonical_form

from schemas.errors import DecodeError
from schemas.events import (
    AbuseAlert,
    BudgetAlert,
    ChatRequest,
    ControlEvent,
    Event,
    KeyRecord,
    OrgRecord,
    RequestsRefused,
    SafetyVerdict,
    StoredCompletion,
    TokenEvent,
    UsageEvent,
)

AVRO_DIR = Path(__file__).parent / "avro"
MAGIC = b"\xc3\x01"
HEADER_LEN = len(MAGIC) + 8

#: schema folder of each event model
SCHEMA_DIRS: dict[type[Event], str] = {
    ChatRequest: "chat_request",
    TokenEvent: "token_event",
    ControlEvent: "control_event",
    UsageEvent: "usage_event",
    SafetyVerdict: "safety_verdict",
    AbuseAlert: "abuse_alert",
    BudgetAlert: "budget_alert",
    OrgRecord: "org_record",
    KeyRecord: "key_record",
    StoredCompletion: "stored_completion",
    RequestsRefused: "requests_refused",
}

E = TypeVar("E", bound=Event)


@dataclass(frozen=True)
class SchemaVersion:
    event: str
    version: int
    raw: dict[str, Any]
    parsed: Any
    fingerprint: bytes

    @property
    def label(self) -> str:
        return f"{self.event}/v{self.version}"


def _load_version(folder: str, path: Path) -> SchemaVersion:
    raw = json.loads(path.read_text())
    parsed = parse_schema(raw)
    canonical = to_parsing_canonical_form(raw)
    return SchemaVersion(
        event=folder,
        version=int(path.stem.removeprefix("v")),
        raw=raw,
        parsed=parsed,
        fingerprint=bytes.fromhex(fingerprint(canonical, "CRC-64-AVRO")),
    )


@cache
def schema_versions(folder: str) -> tuple[SchemaVersion, ...]:
    """Every released version of one event's schema, oldest first."""
    paths = sorted((AVRO_DIR / folder).glob("v*.avsc"), key=lambda p: int(p.stem.removeprefix("v")))
    if not paths:
        raise FileNotFoundError(f"no Avro schema in {AVRO_DIR / folder}")
    return tuple(_load_version(folder, p) for p in paths)


class EventCodec(Generic[E]):
    """Encodes and decodes one event type. Instances are cheap to share; build one per event type."""

    def __init__(self, model: type[E]) -> None:
        self.model = model
        versions = schema_versions(SCHEMA_DIRS[model])
        self.latest = versions[-1]
        self._by_fingerprint: Mapping[bytes, SchemaVersion] = {v.fingerprint: v for v in versions}

    def encode(self, event: E, *, version: int | None = None) -> bytes:
        return self.encode_dict(event.model_dump(), version=version)

    def encode_dict(self, record: Mapping[str, Any], *, version: int | None = None) -> bytes:
        """``version``: write with that released schema instead of the newest (fields it lacks are left out), for
        readers not upgraded yet."""
        writer = self.latest if version is None else self._version(version)
        buf = io.BytesIO()
        buf.write(MAGIC + writer.fingerprint)
        schemaless_writer(buf, writer.parsed, record)
        return buf.getvalue()

    def _version(self, version: int) -> SchemaVersion:
        for candidate in self._by_fingerprint.values():
            if candidate.version == version:
                return candidate
        raise ValueError(f"{self.model.__name__} has no schema version {version}")

    def decode_dict(self, data: bytes) -> dict[str, Any]:
        if len(data) < HEADER_LEN or data[:2] != MAGIC:
            raise DecodeError(f"not an Avro single-object record ({len(data)} bytes)")
        writer = self._by_fingerprint.get(data[2:HEADER_LEN])
        if writer is None:
            raise DecodeError(
                f"unknown schema fingerprint {data[2:HEADER_LEN].hex()} for {self.model.__name__}"
            )
        reader = None if writer is self.latest else self.latest.parsed
        try:
            record = schemaless_reader(io.BytesIO(data[HEADER_LEN:]), writer.parsed, reader)
        except (EOFError, ValueError, TypeError, IndexError, UnicodeDecodeError) as exc:
            raise DecodeError(f"corrupt {writer.label} record: {exc}") from exc
        if not isinstance(record, dict):
            raise DecodeError(f"{writer.label} record is not a record")
        return record

    def decode(self, data: bytes) -> E:
        return self.model.model_validate(self.decode_dict(data))


@cache
def codec_for(model: type[E]) -> EventCodec[E]:
    return EventCodec(model)
