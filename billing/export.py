"""Usage export for analysts: the committed usage records of a range, decoded from Avro, as CSV or Parquet."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
import pyarrow.parquet as pq

from billing.replay import UsageReplay

Format = Literal["csv", "parquet"]

COLUMNS = ["request_id", "org_id", "key_id", "tier", "model", "prompt_tokens", "completion_tokens", "cached_tokens",
           "finish_reason", "attempt", "worker_id", "requested_at", "started_at", "finished_at", "conversation_id",
           "partition", "offset", "billed"]

SCHEMA = pa.schema([
    ("request_id", pa.string()), ("org_id", pa.string()), ("key_id", pa.string()), ("tier", pa.string()),
    ("model", pa.string()), ("prompt_tokens", pa.int32()), ("completion_tokens", pa.int32()),
    ("cached_tokens", pa.int32()), ("finish_reason", pa.string()), ("attempt", pa.int32()),
    ("worker_id", pa.string()), ("requested_at", pa.timestamp("ms", tz="UTC")),
    ("started_at", pa.timestamp("ms", tz="UTC")), ("finished_at", pa.timestamp("ms", tz="UTC")),
    ("conversation_id", pa.string()), ("partition", pa.int32()), ("offset", pa.int64()), ("billed", pa.bool_()),
])


def rows(replay: UsageReplay) -> list[dict[str, Any]]:
    """One row per committed record; ``billed`` marks the record the ledger bills (the first per request id)."""
    out = []
    for partition, offset, usage in replay.records:
        row = usage.model_dump()
        row.update(partition=partition, offset=offset, billed=replay.first[usage.request_id] is usage)
        out.append(row)
    return out


def write(replay: UsageReplay, path: Path, fmt: Format) -> int:
    data = rows(replay)
    if fmt == "parquet":
        pq.write_table(pa.Table.from_pylist(data, schema=SCHEMA), path)
    else:
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=COLUMNS)
            writer.writeheader()
            for row in data:
                writer.writerow({k: (v.isoformat() if hasattr(v, "isoformat") else v) for k, v in row.items()})
    return len(data)
