"""The abuse detector at least once: what a restart does to its counts (``processor.py``'s guarantee), with no
services.

The detector's real agents run over a fake re-keyed stream; Cassandra, Redis, the tenancy registry and the alerts
topic are fakes. A restart is modelled as Faust's ``at_least_once`` makes it: every table write reached the changelog
as it was made (the tables' sends are not transactional any more, and the consumer reads uncommitted), the new
process recovers the tables from it, and counts again the records after its group's last commit.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import faust
import pytest
from faust.streams import _current_event
from faust.tables.table import Table

from runtime.limiter import Limits
from runtime.settings import Settings
from schemas.codec import codec_for
from schemas.events import AbuseAction, AbuseAlert, Event, RequestsRefused, SafetyStage, SafetyVerdict
from stream_processors.abuse import processor

KEY, ORG = "key-review", "org-review"
#: the org's granted limits: at 6 requests/minute a 10 s burst window admits 7, flagged at 21, suspended at 42
LIMITS = Limits(requests_per_minute=6, tokens_per_minute=10_000, max_concurrent=10)


class Killed(BaseException):
    """The process dies here (SIGKILL): nothing after this line of the agent runs."""


class Suspensions:
    def __init__(self) -> None:
        self.suspended: dict[str, str] = {}
        self.down = False

    async def suspend(self, key_id: str, org_id: str, reason: str, alert_id: str) -> None:
        if self.down:  # Cassandra is down: retry_transient retries until the process is killed
            raise Killed
        self.suspended[key_id] = reason

    async def sync_cache(self) -> int:
        return 0


class Granted:
    def __init__(self, *args: Any, **kwargs: Any) -> None: ...

    async def of(self, org_id: str, tier: str) -> Limits:
        return LIMITS

    async def follow(self) -> None: ...


class Alerts:
    def __init__(self) -> None:
        self.sent: list[AbuseAlert] = []

    async def send(self, *, key: bytes, value: bytes) -> None:
        self.sent.append(codec_for(AbuseAlert).decode(value))


class Record:
    """A re-keyed record as the agent sees it (Faust's event: value, key, message)."""

    def __init__(self, event: Event, timestamp: float, offset: int) -> None:
        self.value = codec_for(type(event)).encode(event)
        self.key = KEY.encode()
        self.message = type("Message", (), {"timestamp": timestamp, "partition": 0, "offset": offset,
                                             "topic": "re-keyed"})()


class Stream:
    def __init__(self, records: list[Record]) -> None:
        self._records = records

    def group_by(self, *args: Any, **kwargs: Any) -> Stream:
        return self

    async def events(self) -> Any:
        for record in self._records:
            _current_event.set(weakref.ref(record))  # type: ignore[arg-type]  # as Faust's stream iteration does
            yield record


class Changelog:
    """Every table write of every process, as the changelog topics keep them."""

    def __init__(self) -> None:
        self.writes: list[tuple[str, Any, Any]] = []

    def send(self, table: Table, partition: int | None, key: Any, value: Any, *args: Any) -> Any:
        self.writes.append((table.name, key, value))
        return type("Sent", (), {"message": type("Message", (), {"partition": partition or 0})()})()

    def recover(self, app: faust.App) -> None:
        for name, key, value in self.writes:
            table: Any = app.tables[name]
            table.data[key] = value


class Detector:
    """One process of the abuse detector: its real agents, over fakes."""

    def __init__(self, changelog: Changelog) -> None:
        self.app = processor.build(Settings())
        changelog.recover(self.app)

    async def count(self, agent: str, records: list[Record]) -> None:
        (fun,) = [a.fun for name, a in self.app.agents.items() if name.endswith(f".{agent}")]
        await fun(Stream(records))


@pytest.fixture
def world(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Changelog, Suspensions, Alerts]]:
    changelog, suspensions, alerts = Changelog(), Suspensions(), Alerts()
    monkeypatch.setattr(Table, "send_changelog", lambda table, *args: changelog.send(table, *args))
    monkeypatch.setattr(processor, "connect", lambda *args, **kwargs: (None, None))
    monkeypatch.setattr(processor, "make_redis", lambda *args, **kwargs: None)
    monkeypatch.setattr(processor, "TenancyView", lambda *args, **kwargs: None)
    monkeypatch.setattr(processor, "GrantedLimits", Granted)
    monkeypatch.setattr(processor, "KeySuspensions", lambda *args, **kwargs: suspensions)
    alerter = processor.Alerter

    class Alerter(alerter):  # type: ignore[misc,valid-type]
        def __init__(self, app: faust.App, settings: Settings, suspensions: Any) -> None:
            super().__init__(app, settings, suspensions)
            self._topic = alerts

    monkeypatch.setattr(processor, "Alerter", Alerter)
    yield changelog, suspensions, alerts


def refused(count: int) -> RequestsRefused:
    now = datetime.now(UTC)
    return RequestsRefused(key_id=KEY, org_id=ORG, tier="free", refused=count, first_at=now, last_at=now,
                           gateway_id="gw-review")


def blocked(i: int) -> SafetyVerdict:
    return SafetyVerdict(request_id=f"chatcmpl-{i}", stage=SafetyStage.PRE, blocked=True, category="harm",
                         score=0.99, classifier="review", org_id=ORG, key_id=KEY, decided_at=datetime.now(UTC))


async def test_a_key_whose_suspension_a_restart_interrupted_is_suspended_when_its_record_is_counted_again(
        world: tuple[Changelog, Suspensions, Alerts]) -> None:
    """Cassandra is down while the detector suspends a key (``retry_transient`` retries for as long as it is), and
    the detector is killed meanwhile. Its record's offset was never committed, so the next process counts it again:
    the key must then be suspended. Had the count reached the changelog before the suspension was tried, the record
    counted again would no longer *cross* the threshold: the SUSPEND alert out, the key never suspended
    (in this window; ``safety_violations``' is 600 s). So the count is written after the suspension."""
    changelog, suspensions, alerts = world
    record = Record(refused(42), time.time(), offset=7)  # 42: this window's suspension threshold at 6 rpm
    suspensions.down = True
    with pytest.raises(Killed):
        await Detector(changelog).count("refusals", [record])
    assert [a.action for a in alerts.sent] == [AbuseAction.SUSPEND]  # already out, before the suspension

    suspensions.down = False
    await Detector(changelog).count("refusals", [record])  # restarted: offset 7 again

    assert KEY in suspensions.suspended, "the SUSPEND alert was raised, and the key is not suspended"


async def test_counting_again_after_a_restart_does_not_suspend_a_key_that_was_only_flagged(
        world: tuple[Changelog, Suspensions, Alerts]) -> None:
    """``safety_violations`` has absolute thresholds (3 flag, 6 suspend), not multiples of any limit: a key whose 3
    prompts were blocked within one commit interval (1 s) is flagged, and a restart before the commit counts them
    again. Counted as a number, that is 6: suspended. Counted as distinct requests, still 3."""
    changelog, suspensions, alerts = world
    at = time.time()
    verdicts = [Record(blocked(i), at, offset=i) for i in range(3)]
    await Detector(changelog).count("safety_violations", verdicts)
    assert [a.action for a in alerts.sent] == [AbuseAction.FLAG]

    # killed before its group committed offsets 0-2: the next process counts them again
    await Detector(changelog).count("safety_violations", verdicts)

    assert KEY not in suspensions.suspended, "3 blocked prompts, counted twice after a restart, suspended the key"
