"""Abuse thresholds from the org's effective limits, crossing detection, deterministic alert ids; and the request
burst rule against the gateway's own admission: a key within its org's limits, or retrying as Retry-After says,
is never flagged; a key hammering through its 429s is."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from collections.abc import Callable

from producers.gateway.admission import Admission
from producers.gateway.errors import ApiError
from producers.gateway.local_limiter import LocalLimiter
from runtime.limiter import Limits
from runtime.settings import REPO_ROOT, AbuseSettings, TierTable
from runtime.tenancy import ApiKey, limits_for
from schemas.events import AbuseAction, LimitOverrides
from stream_processors.abuse.rules import Rule, Thresholds, alert_id, decide, thresholds, window_start
from tests.fakes.tenancy import api_key

SETTINGS = AbuseSettings()
TIERS = TierTable.model_validate({})
#: the measured case: ``kns orgs create X --tier free --rpm 60 --concurrent 500``
GRANTED = api_key(tier="free", limits=LimitOverrides(requests_per_minute=60, max_concurrent=500))


def burst_thresholds(key: ApiKey) -> Thresholds:
    return thresholds(Rule.REQUEST_BURST, SETTINGS, limits_for(key.org, TIERS))


def test_burst_thresholds_come_from_the_orgs_own_limits_not_its_tiers() -> None:
    # what a 60 rpm bucket admits in 10 s: a full bucket (60) and 10 s of refill (10); flagged at 3x, suspended at 2x
    assert burst_thresholds(GRANTED) == Thresholds(210, 420, 10)
    assert burst_thresholds(api_key(tier="free")) == Thresholds(105, 210, 10)  # the tier's 30 rpm
    velocity = thresholds(Rule.TOKEN_VELOCITY, SETTINGS, Limits(60, 90_000, 4))
    assert (velocity.flag, velocity.window_s) == (90_000 * 2 * 3, 60)


def test_a_rule_fires_once_when_a_count_crosses_its_threshold() -> None:
    t = burst_thresholds(api_key(tier="free"))
    decisions = [decide(n - 1, n, t) for n in range(1, 241)]
    assert decisions.count(AbuseAction.FLAG) == 1 and decisions[104] is AbuseAction.FLAG
    assert decisions.count(AbuseAction.SUSPEND) == 1 and decisions[209] is AbuseAction.SUSPEND
    # a jump over both thresholds at once suspends
    assert decide(0, 1000, t) is AbuseAction.SUSPEND


class Burst:
    """A key's requests through the gateway's admission (its limiter on a virtual clock), counted as the detector
    counts them: each admitted request and each refusal (429) in the tumbling window of its time."""

    def __init__(self, key: ApiKey) -> None:
        self.now = 1_700_000_000.0
        self.key = key
        self.refused = 0
        limiter = LocalLimiter(clock=lambda: self.now)
        self.admission = Admission(limiter, LocalLimiter(), TIERS, on_refused=self._refused)
        self.attempts: Counter[float] = Counter()
        self.admitted = 0

    def _refused(self, key: ApiKey) -> None:
        assert key is self.key
        self.refused += 1

    async def request(self) -> int | None:
        """Sends one request: None when admitted, else the milliseconds its Retry-After asks to wait."""
        self.attempts[window_start(self.now, SETTINGS.burst_window_s)] += 1
        try:
            ticket = await self.admission.admit(f"r{sum(self.attempts.values())}", 100, self.key)
        except ApiError as exc:
            assert exc.status == 429
            return int((exc.headers or {})["retry-after-ms"])
        self.admitted += 1
        await self.admission.end(ticket, 0)
        return None

    def actions(self) -> list[AbuseAction]:
        """What the detector raises over these windows."""
        t = burst_thresholds(self.key)
        return [a for count in self.attempts.values() if (a := decide(0, count, t)) is not None]


async def test_the_measured_burst_at_the_granted_limit_is_neither_flagged_nor_suspended() -> None:
    burst = Burst(GRANTED)
    for _ in range(69):
        await burst.request()
        burst.now += 0.005
    assert burst.admitted == 60 and burst.refused == 9  # the limiter is exact
    assert burst.actions() == []


async def test_a_key_that_stays_within_its_limits_is_never_flagged() -> None:
    """Bursts as large as the bucket allows, every time it is full again, for ten minutes."""
    burst = Burst(GRANTED)
    for _ in range(10):
        for _ in range(60):
            assert await burst.request() is None
        burst.now += 60.0
    assert burst.refused == 0 and burst.actions() == []


async def _retrying(burst: Burst, requests: int, wait_s: Callable[[int, int], float]) -> None:
    """One client sending ``requests`` back to back; after a refusal it waits ``wait_s(retry_after_ms, attempt)``."""
    for _ in range(requests):
        attempt = 0
        while (retry_after_ms := await burst.request()) is not None:
            burst.now += wait_s(retry_after_ms, attempt)
            attempt += 1
        burst.now += 0.001


async def test_a_client_that_retries_when_retry_after_says_is_never_flagged() -> None:
    burst = Burst(GRANTED)
    await _retrying(burst, 600, lambda retry_after_ms, _: retry_after_ms / 1000)
    assert burst.refused >= 500  # it met the limit the whole time
    assert burst.actions() == []


async def test_a_client_with_exponential_backoff_that_ignores_retry_after_is_never_flagged() -> None:
    burst = Burst(api_key(tier="free"))  # the tier's own 30 rpm
    await _retrying(burst, 300, lambda _ms, attempt: min(0.5 * 2**attempt, 8))  # 0.5 s doubling up to 8 s
    assert burst.refused > 0 and burst.actions() == []


async def test_a_client_hammering_through_its_429s_is_flagged_then_suspended() -> None:
    burst = Burst(GRANTED)
    await _retrying(burst, 100, lambda _ms, _attempt: 0.01)  # retries every 10 ms, whatever Retry-After says
    assert AbuseAction.SUSPEND in burst.actions()
    hammered = Burst(GRANTED)
    await _retrying(hammered, 100, lambda _ms, _attempt: 0.05)  # 20 a second, 20x the refill: a flag
    assert AbuseAction.FLAG in hammered.actions()


def test_alert_ids_are_deterministic_per_rule_key_window_and_action_across_processes() -> None:
    start = window_start(1_700_000_007.5, 10)
    assert start == 1_700_000_000
    a = alert_id(Rule.REQUEST_BURST, "k1", start, AbuseAction.FLAG)
    # the compaction key: another processor instance (another process, another string-hash seed) names it the same
    other = subprocess.run([sys.executable, "-c", "from schemas.events import AbuseAction; from stream_processors."
                            "abuse.rules import Rule, alert_id; print(alert_id(Rule.REQUEST_BURST, 'k1', "
                            f"{start}, AbuseAction.FLAG))"], cwd=REPO_ROOT, capture_output=True, text=True,
                           check=True, env={**os.environ, "PYTHONHASHSEED": "12345"})
    assert other.stdout.strip() == a
    assert a != alert_id(Rule.REQUEST_BURST, "k1", start, AbuseAction.SUSPEND)
    assert a != alert_id(Rule.REQUEST_BURST, "k1", start + 10, AbuseAction.FLAG)
