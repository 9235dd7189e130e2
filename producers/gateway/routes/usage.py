"""``GET /v1/usage``: the caller's organisation's usage and cost, from the billing ledger.

``start`` and ``end`` are ISO 8601 times or Unix seconds (``end`` defaults to now, the range is half-open and at
most 93 days); ``group_by`` is ``model`` or ``day``. Costs are decimal strings in USD: exact, no float rounding.
The sums come from the hourly aggregates, with the ledger's own rows (paged) for the hours the range cuts and the
hours billing has not recomputed yet (``Ledger.usage``): a report never holds the range's rows.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from fastapi import APIRouter, Query

from billing.ledger import Totals, parse_instant
from producers.gateway.deps import Caller, Context
from producers.gateway.errors import bad_request

router = APIRouter()
MAX_RANGE = timedelta(days=93)


def parse_time(value: str, param: str) -> datetime:
    try:
        return parse_instant(value)
    except ValueError as exc:
        raise bad_request(f"'{param}' must be an ISO 8601 time or Unix seconds, got {value!r}.", param=param,
                          code="invalid_value") from exc


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


@router.get("/v1/usage")
async def usage(ctx: Context, key: Caller, start: str = Query(...), end: str | None = Query(None),
                group_by: str = Query("model")) -> dict[str, Any]:
    await ctx.admission.admit_read(key)
    begin = parse_time(start, "start")
    finish = parse_time(end, "end") if end is not None else datetime.now(UTC)
    if finish <= begin:
        raise bad_request("'end' must be after 'start'.", param="end", code="invalid_value")
    if finish - begin > MAX_RANGE:
        raise bad_request(f"The range may span at most {MAX_RANGE.days} days.", param="start", code="invalid_value")
    if group_by not in ("model", "day"):
        raise bad_request("'group_by' must be 'model' or 'day'.", param="group_by", code="invalid_value")
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
