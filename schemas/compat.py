"""Schema evolution checks: can the newest reader decode what every older writer wrote?

``sample_record`` builds a record that exercises every field of a schema (non-null union branches, one-element
arrays, every record nested); ``backward_compatible`` writes it with the old schema and reads it with the new
one through Avro schema resolution. Used by the contract tests for every released version.
"""

from __future__ import annotations

import io
from typing import Any

from fastavro import parse_schema, schemaless_reader, schemaless_writer
from fastavro.read import SchemaResolutionError

_PRIMITIVES: dict[str, Any] = {
    "string": "s", "bytes": b"b", "int": 7, "long": 1_700_000_000_000, "float": 1.5, "double": 2.5,
    "boolean": True, "null": None,
}


def sample_record(schema: Any, named: dict[str, Any] | None = None) -> Any:
    named = {} if named is None else named
    if isinstance(schema, str):
        return sample_record(named[schema], named) if schema in named else _PRIMITIVES[schema]
    if isinstance(schema, list):
        non_null = [s for s in schema if s != "null"]
        return sample_record(non_null[0], named) if non_null else None
    kind = schema["type"]
    if kind == "record":
        named[schema["name"]] = schema
        if "namespace" in schema:
            named[f"{schema['namespace']}.{schema['name']}"] = schema
        return {f["name"]: sample_record(f["type"], named) for f in schema["fields"]}
    if kind == "enum":
        named[schema["name"]] = schema
        return schema["symbols"][0]
    if kind == "array":
        return [sample_record(schema["items"], named)]
    if kind == "map":
        return {"k": sample_record(schema["values"], named)}
    if kind == "fixed":
        return b"\0" * schema["size"]
    if "logicalType" in schema:
        return _PRIMITIVES[kind]
    return sample_record(kind, named)


def backward_compatible(old: dict[str, Any], new: dict[str, Any]) -> tuple[bool, str]:
    """(True, "") when data written with ``old`` reads with ``new``; else (False, why)."""
    buf = io.BytesIO()
    schemaless_writer(buf, parse_schema(old), sample_record(old))
    buf.seek(0)
    try:
        schemaless_reader(buf, parse_schema(old), parse_schema(new))
    except SchemaResolutionError as exc:
        return False, str(exc)
    return True, ""
