"""Prices: the version valid at the request's time; exact decimal costs; cached tokens at the cached rate."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal

import pytest

from billing.prices import Price, PriceBook, UnknownPrice, load_seed

JAN = datetime(2026, 1, 1, tzinfo=UTC)
JUN = datetime(2026, 6, 1, tzinfo=UTC)


def book() -> PriceBook:
    return PriceBook([
        Price("m", JUN, "v2", Decimal("0.10"), Decimal("0.05"), Decimal("0.40")),
        Price("m", JAN, "v1", Decimal("0.05"), Decimal("0.025"), Decimal("0.20")),
    ])


def test_the_price_valid_at_the_request_time_applies() -> None:
    prices = book()
    assert prices.price_at("m", datetime(2026, 3, 1, tzinfo=UTC)).version == "v1"
    assert prices.price_at("m", JUN).version == "v2"  # valid from its first instant
    assert prices.price_at("m", datetime(2026, 5, 31, 23, 59, 59, tzinfo=UTC)).version == "v1"


def test_no_price_before_the_first_version_or_for_unknown_models() -> None:
    with pytest.raises(UnknownPrice):
        book().price_at("m", datetime(2025, 12, 31, tzinfo=UTC))
    with pytest.raises(UnknownPrice):
        book().price_at("other", JUN)


def test_cost_is_exact_and_bills_cached_prompt_tokens_at_the_cached_rate() -> None:
    price = book().price_at("m", JAN)
    # 37 prompt tokens of which 16 cached, 8 completion: (21*0.05 + 16*0.025 + 8*0.20) / 1e6
    assert price.cost(37, 8, 16) == Decimal("0.00000305")
    assert price.cost(0, 0, 0) == 0


def test_the_seed_file_prices_the_served_model() -> None:
    (price,) = load_seed()
    assert price.model == "SmolLM2-135M-Instruct" and price.output_per_mtok > price.input_per_mtok
