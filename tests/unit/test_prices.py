"""Prices: the version valid at the request's time; exact decimal costs; cached tokens at the cached rate; new
versions never edit one and start far enough ahead; a book never prices a time it cannot vouch for."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from cassandra.cluster import NoHostAvailable

from billing.prices import (
    LivePrices,
    Price,
    PriceBook,
    PriceBookStale,
    PriceExists,
    PriceLead,
    PriceRefused,
    UnknownPrice,
    check_new_price,
    load_seed,
)

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


# --- new versions: never an edit, never too soon (the rules behind `kns billing set-price`) ----------------------

NOW = datetime(2026, 11, 22, 10, 0, tzinfo=UTC)
LEAD = PriceLead(reload_s=60)


def version(at: datetime, label: str, output: str = "0.40") -> Price:
    return Price("m", at, label, Decimal("0.10"), Decimal("0.05"), Decimal(output))


def test_the_minimum_lead_is_derived_from_the_reload_interval() -> None:
    # two reload intervals (a processor that missed one reload still has the price) plus the settling margin
    assert LEAD.minimum == timedelta(minutes=3)
    assert PriceLead(reload_s=10).minimum == timedelta(seconds=80)
    assert LEAD.reach == timedelta(minutes=2)  # how long past its load a book can vouch for the table


def test_a_new_price_in_the_past_is_refused_with_the_minimum_lead_in_the_message() -> None:
    with pytest.raises(PriceRefused) as refused:
        check_new_price(book().all(), version(NOW - timedelta(hours=1), "v3"), now=NOW, lead=LEAD)
    message = str(refused.value)
    assert "in the past" in message and "3 min" in message and "60 s" in message and "\n" not in message


def test_a_new_price_too_close_to_now_is_refused_and_one_far_enough_is_accepted() -> None:
    with pytest.raises(PriceRefused, match="only 2 min from now"):
        check_new_price(book().all(), version(NOW + timedelta(minutes=2), "v3"), now=NOW, lead=LEAD)
    check_new_price(book().all(), version(NOW + timedelta(minutes=3), "v3"), now=NOW, lead=LEAD)


def test_an_existing_valid_from_or_version_label_is_refused() -> None:
    with pytest.raises(PriceExists, match="never edited"):
        check_new_price(book().all(), version(JUN, "v9", output="9"), now=datetime(2026, 1, 1, tzinfo=UTC),
                        lead=LEAD)
    with pytest.raises(PriceRefused, match="'v2' is already"):
        check_new_price(book().all(), version(NOW + timedelta(days=1), "v2"), now=NOW, lead=LEAD)


def test_only_an_unpriced_stretch_may_be_priced_in_the_past() -> None:
    # a model's first price, or one before its first: nothing was billed there (its usage was dead-lettered)
    check_new_price([], version(NOW - timedelta(days=30), "v1"), now=NOW, lead=LEAD)
    check_new_price(book().all(), version(JAN - timedelta(days=30), "v0"), now=NOW, lead=LEAD)


def test_negative_or_non_finite_rates_are_refused() -> None:
    with pytest.raises(PriceRefused, match="output_per_mtok"):
        check_new_price([], version(NOW + timedelta(days=1), "v1", output="-1"), now=NOW, lead=LEAD)
    with pytest.raises(PriceRefused, match="output_per_mtok"):
        check_new_price([], version(NOW + timedelta(days=1), "v1", output="NaN"), now=NOW, lead=LEAD)


# --- the book a processor prices with: it knows how far it can vouch for the table -------------------------------


def test_a_book_refuses_a_time_past_what_it_can_vouch_for() -> None:
    horizon = datetime(2026, 7, 1, tzinfo=UTC)
    prices = PriceBook(book().all(), complete_until=horizon)
    assert prices.price_at("m", horizon - timedelta(microseconds=1)).version == "v2"
    with pytest.raises(PriceBookStale, match="reload"):
        prices.price_at("m", horizon)
    assert issubclass(PriceBookStale, UnknownPrice)  # not billable now: dead-lettered, never priced stale


@dataclass
class FlakyTable:
    """A price table that is down for ``failures`` loads, then answers with ``book``."""

    book: PriceBook
    failures: int = 0
    loads: int = 0

    async def load(self) -> PriceBook:
        self.loads += 1
        if self.loads <= self.failures:
            raise NoHostAvailable("Cassandra down", {})
        return self.book


async def test_a_stale_book_is_reloaded_before_pricing_and_waits_out_an_outage() -> None:
    at = datetime(2026, 7, 2, tzinfo=UTC)
    old = PriceBook([version(JAN, "v1")], complete_until=datetime(2026, 7, 1, tzinfo=UTC))  # reloads failed since
    table = FlakyTable(PriceBook(book().all(), complete_until=at + timedelta(minutes=2)), failures=2)
    live = LivePrices(table, old)
    priced = (await live.book_for(at)).price_at("m", at)
    assert priced.version == "v2" and table.loads == 3  # not v1 from the book it had
    await live.book_for(at)
    assert table.loads == 3  # a book that vouches for the time is used as it is


async def test_a_time_even_a_fresh_book_cannot_vouch_for_is_refused() -> None:
    at = datetime(2026, 7, 2, tzinfo=UTC)
    table = FlakyTable(PriceBook(book().all(), complete_until=at))
    live = LivePrices(table, PriceBook(book().all(), complete_until=at - timedelta(hours=1)))
    with pytest.raises(PriceBookStale):
        (await live.book_for(at)).price_at("m", at)
