"""``GET /v1/usage``: the caller's organisation's usage and cost, from the billing ledger.

``start`` and ``end`` are ISO 8601 times or Unix seconds (``end`` defaults to now, the range is half-open and at
most 93 days); ``group_by`` is ``model`` or ``day``. Costs are decimal strings in USD: exact, no float rounding.
The sums come from the hourly aggregates, with the ledger's own rows (paged) for the hours the range cuts and the
hours billing has not recomputed yet (``Ledger.usage``): a report never holds the range's rows.
"""

from __future__ import annotations

import math
import re
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from fastapi import APIRouter, Query

from billing.ledger import Totals, parse_instant
from producers.gateway.deps import Caller, Context
from producers.gateway.errors import CALLER_ERRORS, READ_LIMITED, bad_request, error_responses

router = APIRouter(responses=CALLER_ERRORS)
MAX_RANGE = timedelta(days=93)
#: a report takes one read of its key's read bucket per this much of its range (``read_cost``)
READ_SPAN = timedelta(days=7)
#: What ``start`` and ``end`` may be, as ``/openapi.json`` says: Unix seconds, or an ISO 8601 date or time (UTC
#: unless it says otherwise); checked before parsing, so that the server refuses whatever the document does
INSTANT = (r"^([0-9]{1,11}(\.[0-9]{1,6})?|[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
           r"([T ]([01][0-9]|2[0-3]):[0-5][0-9](:[0-5][0-9](\.[0-9]{1,6})?)?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])?)?)$")
_INSTANT = re.compile(INSTANT)


def _instant(description: str, **query: Any) -> Any:
    return Query(**query, description=description, json_schema_extra={"pattern": INSTANT})


def parse_time(value: str, param: str) -> datetime:
    try:
        if not _INSTANT.match(value):
            raise ValueError(value)
        return parse_instant(value)
    except ValueError as exc:
        raise bad_request(f"'{param}' must be an ISO 8601 time or Unix seconds, got {value!r}.", param=param,
                          code="invalid_value") from exc


def read_cost(span: timedelta) -> int:
    """The reads a report takes: one per week of its range, begun. A report reads a partition per day of its range
    (its hourly aggregates): a 93-day one costs the gateway ~0.2 s of CPU, a list read a few ms, and a tenant
    asking for it as often as for a list moved another tenant's TTFT p99 by ~0.1 s (``kns bench flood``)."""
    return max(1, math.ceil(span / READ_SPAN))


def _line(totals: Totals) -> dict[str, Any]:
    return {
        "requests": totals.requests,
        "prompt_tokens": totals.prompt_tokens,
        "completion_tokens": totals.completion_tokens,
        "cached_tokens": totals.cached_tokens,
        "total_tokens": totals.prompt_tokens + totals.completion_tokens,
        "cost_usd": str(totals.cost),
    }


def _by_model(model: str, _at: datetime) -> str:
    return model


def _by_day(_model: str, at: datetime) -> str:
    return at.date().isoformat()


@router.get("/v1/usage", operation_id="getUsage", responses=error_responses({
    400: "A malformed `start`, `end` or `group_by`, `end` not after `start`, or a range of more than 93 days.",
}) | READ_LIMITED)
async def usage(ctx: Context, key: Caller,
                start: str = _instant("The range's start (inclusive): Unix seconds or ISO 8601.", default=...),
                end: str | None = _instant("The range's end (exclusive); now when absent.", default=None),
                group_by: Literal["model", "day"] = Query("model")) -> dict[str, Any]:
    begin = parse_time(start, "start")
    finish = parse_time(end, "end") if end is not None else datetime.now(UTC)
    if finish <= begin:
        raise bad_request("'end' must be after 'start'.", param="end", code="invalid_value")
    if finish - begin > MAX_RANGE:
        raise bad_request(f"The range may span at most {MAX_RANGE.days} days.", param="start", code="invalid_value")
    await ctx.admission.admit_read(key, cost=read_cost(finish - begin))
    groups = await ctx.ledger.usage(key.org_id, begin, finish, _by_model if group_by == "model" else _by_day)
    total = sum(groups.values(), Totals())
    return {
        "object": "usage.report",
        "org_id": key.org_id,
        "start": begin.isoformat(),
        "end": finish.isoformat(),
        "group_by": group_by,
        "data": [{group_by: label, **_line(t)} for label, t in sorted(groups.items())],
        "total": _line(total),
    }
