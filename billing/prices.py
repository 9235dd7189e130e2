"""Versioned prices: USD per million tokens, per model, each valid from a point in time.

The seed lives in ``billing/prices.v*.json`` (the newest file is loaded into Cassandra by provisioning); new
prices are added as new rows (``kns billing set-price``), never edited, so any past request can be re-priced
exactly. Costs are ``Decimal``: no float ever touches money.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

from cassandra.cluster import Session

from runtime.cassandra_client import execute

MTOK = Decimal(1_000_000)
PRICE_FILES = sorted(Path(__file__).parent.glob("prices.v*.json"), key=lambda p: int(p.stem.split(".v")[1]))


@dataclass(frozen=True)
class Price:
    model: str
    valid_from: datetime
    version: str
    input_per_mtok: Decimal
    cached_input_per_mtok: Decimal
    output_per_mtok: Decimal

    def cost(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Decimal:
        """Cached prompt tokens are part of prompt_tokens (OpenAI's convention) and billed at the cached rate."""
        uncached = max(0, prompt_tokens - cached_tokens)
        return (
            uncached * self.input_per_mtok
            + cached_tokens * self.cached_input_per_mtok
            + completion_tokens * self.output_per_mtok
        ) / MTOK


class UnknownPrice(LookupError):
    pass


class PriceBook:
    """All price versions, per model, ordered by validity."""

    def __init__(self, prices: list[Price]) -> None:
        self._by_model: dict[str, list[Price]] = {}
        for price in sorted(prices, key=lambda p: p.valid_from):
            self._by_model.setdefault(price.model, []).append(price)

    def price_at(self, model: str, at: datetime) -> Price:
        versions = self._by_model.get(model)
        if not versions:
            raise UnknownPrice(f"no price for model {model!r}")
        index = bisect.bisect_right([p.valid_from for p in versions], at) - 1
        if index < 0:
            raise UnknownPrice(f"no price for {model!r} valid at {at.isoformat()}")
        return versions[index]

    def all(self) -> list[Price]:
        return [p for versions in self._by_model.values() for p in versions]


def load_seed(path: Path | None = None) -> list[Price]:
    data = json.loads((path or PRICE_FILES[-1]).read_text())
    return [
        Price(
            model=row["model"],
            valid_from=datetime.fromisoformat(row["valid_from"].replace("Z", "+00:00")),
            version=row["version"],
            input_per_mtok=Decimal(row["input_per_mtok"]),
            cached_input_per_mtok=Decimal(row["cached_input_per_mtok"]),
            output_per_mtok=Decimal(row["output_per_mtok"]),
        )
        for row in data["prices"]
    ]


class PriceStore:
    """The price table in Cassandra (``prices``): seeded from the newest ``prices.v*.json``, appended to after."""

    def __init__(self, session: Session, keyspace: str) -> None:
        self._session = session
        self._select = (f"SELECT model, valid_from, version, input_per_mtok, cached_input_per_mtok, output_per_mtok "
                        f"FROM {keyspace}.prices")
        self._insert = session.prepare(
            f"INSERT INTO {keyspace}.prices (model, valid_from, version, input_per_mtok, cached_input_per_mtok, "
            "output_per_mtok) VALUES (?, ?, ?, ?, ?, ?)")

    @staticmethod
    def _price(row: dict[str, Any]) -> Price:
        valid_from = row["valid_from"]
        return Price(row["model"], valid_from.replace(tzinfo=UTC) if valid_from.tzinfo is None else valid_from,
                     row["version"], row["input_per_mtok"], row["cached_input_per_mtok"], row["output_per_mtok"])

    def load_sync(self) -> PriceBook:
        return PriceBook([self._price(r) for r in self._session.execute(self._select)])

    async def load(self) -> PriceBook:
        return PriceBook([self._price(r) for r in await execute(self._session, self._select)])

    async def add(self, price: Price) -> None:
        await execute(self._session, self._insert, [price.model, price.valid_from, price.version,
                                                    price.input_per_mtok, price.cached_input_per_mtok,
                                                    price.output_per_mtok])

    async def seed(self, prices: list[Price]) -> None:
        """Idempotent: the same rows every time."""
        for price in prices:
            await self.add(price)
