"""Monthly budgets on the real stack (issue 9 item 3): an org whose spend (ledger + holds of requests in flight)
would pass its budget gets 429 insufficient_quota, crossing the alert fraction puts a BudgetAlert on the alerts
topic, raising the budget serves the org again at once, and the spend Redis keeps equals the ledger's sum to the
nano-dollar once a load has ended."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import httpx
import pytest

from billing.ledger import Ledger
from producers.tenancy.admin import OrgUpdate, open_admin
from runtime.cassandra_client import connect_async
from runtime.redis_client import key as redis_key
from runtime.redis_client import make_redis
from runtime.settings import Settings
from runtime.spend import Spend, SpendBook, ledger_nanos, month_of
from schemas.events import BudgetAlert
from schemas.topics import TOPICS
from tests.conftest import GATEWAY_PORT, SESSION
from tests.e2e.conftest import MODEL, kns, records_of
from tests.helpers import ServiceProcess, wait_for

pytestmark = pytest.mark.e2e
URL = f"http://127.0.0.1:{GATEWAY_PORT}/v1/chat/completions"


async def _set_budget(stack: Settings, org: str, usd: str, fraction: float | None = None) -> None:
    async with open_admin(stack) as admin:
        await admin.update_org(org, OrgUpdate(monthly_budget_usd=Decimal(usd), budget_alert_fraction=fraction))


async def _ask(http: httpx.AsyncClient, secret: str, i: int, *, stream: bool = False) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"Count to {i}."}], "max_tokens": 16,
            "temperature": 0, "stream": stream}
    return await http.post(URL, json=body, headers={"Authorization": f"Bearer {secret}"})


class Spending:
    def __init__(self, stack: Settings, org: str) -> None:
        self.stack, self.org, self.month = stack, org, month_of(datetime.now(UTC))

    async def __aenter__(self) -> Spending:
        self.redis = make_redis(self.stack.redis)
        self.book = SpendBook(self.redis, self.stack.redis)
        self.cluster, session = await connect_async(self.stack.cassandra)
        self.ledger = await Ledger.open(session, self.stack.cassandra.keyspace)
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.redis.aclose()
        await asyncio.to_thread(self.cluster.shutdown)

    async def spend(self) -> Spend:
        return await self.book.read(self.org, self.month)

    async def ledger_rows(self) -> list[dict[str, object]]:
        now = datetime.now(UTC)
        return await self.ledger.rows_for_org(self.org, now - timedelta(hours=1), now + timedelta(minutes=5))

    async def ledger_nanos(self) -> int:
        return ledger_nanos(Decimal(str(r["cost"])) for r in await self.ledger_rows())

    async def lose_redis_data(self) -> None:
        """What a Redis without persistence keeps of this org's month after a restart: nothing, marks included."""
        marks = [redis_key(self.stack.redis, "spend", "charged", str(r["request_id"]))
                 for r in await self.ledger_rows()]
        await self.redis.delete(*self.book.keys(self.org, self.month).all(), *marks)

    async def settled(self, requests: int) -> bool:
        """Billing caught up: every request is in the ledger and no hold is left."""
        spend = await self.spend()
        return spend.holds == 0 and spend.reserved_nanos == 0 and len(await self.ledger_rows()) == requests


@pytest.mark.timeout(300)  # 40 answers, each settled before the next
async def test_a_spent_budget_is_429_insufficient_quota_until_it_is_raised(
        make_caller, stack: Settings, gateway: ServiceProcess) -> None:  # type: ignore[no-untyped-def]
    org = f"org-bud-{SESSION}-{uuid.uuid4().hex[:6]}"
    caller = make_caller(org=org, tier="plus")
    # A request here costs a few micro-dollars (about 30 prompt tokens at $0.05/M, up to 16 out at $0.20/M) and holds
    # at most ~5 µ$ while in flight: $0.00004 lasts about ten of them.
    await _set_budget(stack, org, "0.00004", fraction=0.5)
    async with Spending(stack, org) as spending, httpx.AsyncClient(timeout=120) as http:
        served = 0
        for i in range(40):
            answer = await _ask(http, caller.secret, i)
            if answer.status_code == 429:
                break
            assert answer.status_code == 200, answer.text
            served += 1
            # one at a time, each billed before the next: what admission refuses is then the budget alone
            assert await wait_for(lambda n=served: spending.settled(n), timeout_s=60), await spending.spend()
        assert 5 <= served < 40, served
        error = answer.json()["error"]
        assert (error["type"], error["code"]) == ("insufficient_quota", "insufficient_quota"), error
        assert "retry-after" not in answer.headers
        billed = (await spending.spend()).billed_nanos
        assert billed == await spending.ledger_nanos() <= 40_000  # never past the budget
        assert billed > 40_000 * 0.5

        alerts = await records_of(stack, TOPICS.budget_alerts, BudgetAlert, lambda a: a.org_id == org)
        assert {(a.kind, a.budget_usd, a.month) for a in alerts} == {("threshold", "0.00004", spending.month)}
        assert Decimal(alerts[0].billed_usd) >= Decimal("0.00002")

        await _set_budget(stack, org, "1")  # raised: the gateway's registry view has it within its fetch latency

        async def served_again() -> bool:
            return (await _ask(http, caller.secret, 99)).status_code == 200

        assert await wait_for(served_again, timeout_s=2, interval_s=0.1)


@pytest.mark.timeout(300)  # 40 answers at once, then up to 120 s for their settlement
async def test_spend_under_load_equals_the_ledger_to_the_nano_dollar(
        make_caller, stack: Settings, gateway: ServiceProcess,  # type: ignore[no-untyped-def]
        service_env: dict[str, str]) -> None:
    org = f"org-spend-{SESSION}-{uuid.uuid4().hex[:6]}"
    caller = make_caller(org=org, tier="plus")
    await _set_budget(stack, org, "10")
    async with Spending(stack, org) as spending, httpx.AsyncClient(
            timeout=300, limits=httpx.Limits(max_connections=100)) as http:
        answers = await asyncio.gather(*(_ask(http, caller.secret, i, stream=i % 2 == 0) for i in range(40)))
        assert {a.status_code for a in answers} == {200}
        assert await wait_for(lambda: spending.settled(40), timeout_s=120), await spending.spend()
        spend = await spending.spend()
        assert spend.billed_nanos == await spending.ledger_nanos() > 0
        assert (spend.reserved_nanos, spend.holds) == (0, 0)

        # The operator's check agrees; after Redis lost the count, it says so, and --repair restores it.
        checked = await asyncio.to_thread(kns, service_env, "billing", "spend", org)
        assert checked.returncode == 0, checked.stdout + checked.stderr
        await spending.lose_redis_data()
        lost = await asyncio.to_thread(kns, service_env, "billing", "spend", org)
        assert lost.returncode == 1 and "differs from the ledger" in lost.stderr, lost.stdout + lost.stderr
        repaired = await asyncio.to_thread(kns, service_env, "billing", "spend", org, "--repair")
        assert repaired.returncode == 0, repaired.stdout + repaired.stderr
        assert (await spending.spend()).billed_nanos == await spending.ledger_nanos()
        # and a usage event redelivered now is not charged again (the repair restored its mark)
        row = (await spending.ledger_rows())[0]
        again = await spending.book.charge(str(row["request_id"]), org, row["requested_at"], row["cost"])
        assert not again.applied and again.billed_nanos == await spending.ledger_nanos()
