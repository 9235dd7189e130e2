"""GET /v1/usage: totals and cost from the ledger, for the caller's organisation only."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from fractions import Fraction

import httpx
import openai
import pytest

from billing.prices import PriceBook, load_seed
from tests.conftest import SESSION
from tests.e2e.conftest import MODEL
from tests.helpers import wait_for

pytestmark = pytest.mark.e2e


def _by_hand(input_rate: Decimal, cached_rate: Decimal, output_rate: Decimal,
             usage: openai.types.CompletionUsage) -> Fraction:
    """A request's cost in dollars from per-million-token rates, in exact fractions."""
    details = usage.prompt_tokens_details
    cached = (details.cached_tokens or 0) if details is not None else 0
    return (Fraction(input_rate) * (usage.prompt_tokens - cached) + Fraction(cached_rate) * cached
            + Fraction(output_rate) * usage.completion_tokens) / 1_000_000


@pytest.mark.timeout(180)  # answers for two orgs, then up to 60 s for their billing
async def test_usage_reports_the_callers_org_only(base_url: str, make_caller) -> None:  # type: ignore[no-untyped-def]
    start = (datetime.now(UTC) - timedelta(seconds=5)).isoformat()
    alice, bob = make_caller(org=f"org-alice-{SESSION}"), make_caller(org=f"org-bob-{SESSION}")
    spent: dict[str, list[openai.types.CompletionUsage]] = {}
    for caller, n in ((alice, 3), (bob, 2)):
        with openai.OpenAI(base_url=base_url, api_key=caller.secret, max_retries=0) as client:
            spent[caller.key.org_id] = [
                client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"Say {i}."}],
                                               max_tokens=4, temperature=0).usage
                for i in range(n)
            ]

    async def report(secret: str, **params: str) -> httpx.Response:
        async with httpx.AsyncClient(base_url=base_url, headers={"Authorization": f"Bearer {secret}"}) as http:
            return await http.get("/usage", params={"start": start, **params})

    async def billed(secret: str, n: int) -> dict | None:  # type: ignore[type-arg]
        body = (await report(secret)).json()
        return body if body["total"]["requests"] == n else None

    price = PriceBook(load_seed()).price_at(MODEL, datetime.now(UTC))
    for caller in (alice, bob):
        usages = spent[caller.key.org_id]
        body = await wait_for(lambda c=caller, u=usages: billed(c.secret, len(u)), timeout_s=60)
        assert body, f"{caller.key.org_id} was not billed in time"
        assert body["org_id"] == caller.key.org_id
        (line,) = body["data"]
        assert line["model"] == MODEL and line["requests"] == len(usages)
        assert line["prompt_tokens"] == sum(u.prompt_tokens for u in usages)
        assert line["completion_tokens"] == sum(u.completion_tokens for u in usages)
        # by hand from the seed's rates (not billing's Price.cost): uncached and cached prompt tokens, completion
        expected_cost = sum((_by_hand(price.input_per_mtok, price.cached_input_per_mtok, price.output_per_mtok, u)
                             for u in usages), Fraction(0))
        assert Fraction(Decimal(line["cost_usd"])) == expected_cost, (line["cost_usd"], float(expected_cost))
    by_day = (await report(alice.secret, group_by="day")).json()
    assert [row["day"] for row in by_day["data"]] == [datetime.now(UTC).date().isoformat()]


@pytest.mark.parametrize(("params", "param"), [
    ({"start": "yesterday"}, "start"),
    ({"start": "2026-01-02T00:00:00Z", "end": "2026-01-01T00:00:00Z"}, "end"),
    ({"start": "2026-01-01T00:00:00Z", "end": "2026-01-02T00:00:00Z", "group_by": "colour"}, "group_by"),
    ({"start": "2025-01-01T00:00:00Z", "end": "2026-01-01T00:00:00Z"}, "start"),
    ({}, "start"),
])
async def test_bad_ranges_are_400(base_url: str, caller, params: dict[str, str], param: str) -> None:  # type: ignore[no-untyped-def]
    async with httpx.AsyncClient(base_url=base_url, headers={"Authorization": f"Bearer {caller.secret}"}) as http:
        response = await http.get("/usage", params=params)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"


async def test_usage_needs_a_key(base_url: str) -> None:
    async with httpx.AsyncClient() as http:
        assert (await http.get(f"{base_url}/usage", params={"start": "0"})).status_code == 401
    await asyncio.sleep(0)
