"""Abuse detection: windowed counts per API key over requests (admitted and refused), safety verdicts and usage.

Rules (``rules.py``): request bursts (admitted plus refused with 429) far beyond what the key's org's limits admit,
repeated safety violations, token velocity beyond the org's limits, one key used from many client addresses. The
limits are the ones the gateways enforce, read from the tenancy registry this processor follows
(``granted.py``). Each source stream is repartitioned by key id (Faust ``group_by``) so that a key's counts live in
one table partition. A threshold crossing becomes an AbuseAlert on the alerts topic; a suspend-level crossing also
suspends the key (Cassandra + the Redis cache gateways read).

Guarantee: at least once, and never stalled. A count is written only after its alert and suspension are done, so a
process that dies in between (Cassandra down, retried until killed) leaves its record to cross the threshold again
after the restart; alert ids are deterministic and suspension is an idempotent upsert. Safety violations are kept as
distinct request ids, client addresses as distinct addresses, so counting a record again changes nothing (a
violation's id is looked up in the previous window too: a restart's copy of a record is stamped when it is forwarded
again, which may be in the next window). A request burst or token velocity counted again after a restart reads high by
what was processed since the last commit (a commit interval's records): at most a FLAG that would not have been
raised; a key within its limits is not suspended by it (suspension is twice the flag) unless the detector restarts
twice within one window (``test_abuse_restarts``). Not Faust's ``exactly_once``: it runs a transaction per
*destination* partition and commits one only when a source record of that partition is committed, so the records a
``group_by`` forwarded into a partition no source record touched stayed invisible to the ``read_committed`` reader,
uncounted, until the transaction timed out, was aborted (their counts lost) and crashed the processor
(``test_a_key_is_counted_when_no_record_of_any_source_shares_its_rekeyed_partition``). Reading uncommitted, the usage
of worker transactions that were aborted (a failover, a commit retried) counts too: a key's tokens read high by the
aborted attempts' usage.
"""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import faust

from runtime.cassandra_client import connect
from runtime.metrics import ABUSE_ALERTS
from runtime.redis_client import make_redis
from runtime.retry import retry_transient
from runtime.settings import Settings
from runtime.suspensions import KeySuspensions
from runtime.tenancy import TenancyView
from schemas.codec import EventCodec, codec_for
from schemas.errors import DecodeError
from schemas.events import (
    AbuseAction,
    AbuseAlert,
    ChatRequest,
    Event,
    RequestsRefused,
    SafetyVerdict,
    UsageEvent,
    utcnow,
)
from schemas.topics import TOPICS
from stream_processors.abuse.granted import GrantedLimits
from stream_processors.abuse.rules import Rule, Thresholds, alert_id, decide, thresholds, window_start
from stream_processors.app import DeadLetters, build_app, raw_topic

log = logging.getLogger(__name__)
UNDECODABLE = b"undecodable"


def key_of(codec: EventCodec[Any]) -> Any:
    """group_by key function: the record's API key id (undecodable records are dead-lettered downstream)."""

    def key(value: bytes) -> bytes:
        try:
            event = codec.decode(value)
        except DecodeError:
            return UNDECODABLE
        return (getattr(event, "key_id", None) or "unknown").encode()

    return key


class Alerter:
    def __init__(self, app: faust.App, settings: Settings, suspensions: KeySuspensions) -> None:
        self._topic = raw_topic(app, settings, TOPICS.alerts)
        self._codec = codec_for(AbuseAlert)
        self._suspensions = suspensions

    async def check(self, rule: Rule, t: Thresholds, before: float, after: float, *, key_id: str, org_id: str,
                    tier: str, at_s: float) -> None:
        action = decide(before, after, t)
        if action is None:
            return
        start = window_start(at_s, t.window_s)
        alert = AbuseAlert(
            alert_id=alert_id(rule, key_id, start, action), key_id=key_id, org_id=org_id, tier=tier, rule=rule.value,
            observed=after, threshold=t.suspend if action is AbuseAction.SUSPEND else t.flag,
            window_start=datetime.fromtimestamp(start, UTC), window_s=t.window_s, action=action, raised_at=utcnow(),
        )
        await self._topic.send(key=alert.alert_id.encode(), value=self._codec.encode(alert))
        if action is AbuseAction.SUSPEND:
            reason = f"{rule.value}: {after:g} in {t.window_s:g} s (limit {alert.threshold:g})"
            await retry_transient(lambda: self._suspensions.suspend(key_id, org_id, reason, alert.alert_id),
                                  what="suspend key")
        ABUSE_ALERTS.labels(rule=rule.value, action=action.value).inc()
        log.warning("abuse alert", extra={"rule": rule.value, "key_id": key_id, "action": action.value,
                                          "observed": after, "alert_id": alert.alert_id})


def _window_table(app: faust.App, name: str, window_s: float, default: type) -> Any:
    return (app.Table(name, default=default)
            .tumbling(window_s, expires=timedelta(seconds=window_s * 4))
            .relative_to_stream())


def build(settings: Settings) -> faust.App:
    ab = settings.abuse
    app = build_app(settings, "abuse", guarantee="at_least_once")
    granted = GrantedLimits(TenancyView(settings.kafka, catch_up_timeout_s=settings.tenancy.catch_up_timeout_s),
                            settings.tenancy.tiers)
    _cluster, session = connect(settings.cassandra, keyspace=settings.cassandra.keyspace)
    suspensions = KeySuspensions(session, settings.cassandra.keyspace, make_redis(settings.redis), settings.redis)
    alerter = Alerter(app, settings, suspensions)
    dead = DeadLetters(app, settings, "abuse")
    burst = _window_table(app, "abuse-burst", ab.burst_window_s, int)
    addresses = _window_table(app, "abuse-addresses", ab.addresses_window_s, list)
    # the ids of the window's blocked requests, not a count: a verdict counted again after a restart is not a second
    violations = _window_table(app, "abuse-blocked-requests", ab.violations_window_s, list)
    velocity = _window_table(app, "abuse-velocity", ab.velocity_window_s, int)
    request_codec, verdict_codec, usage_codec = codec_for(ChatRequest), codec_for(SafetyVerdict), codec_for(UsageEvent)
    refused_codec = codec_for(RequestsRefused)

    max_age = 2 * max(ab.burst_window_s, ab.violations_window_s, ab.velocity_window_s, ab.addresses_window_s)

    # Declared here, not at the agents' start: the runner creates them before the Faust worker starts.
    by_key = {name: app.repartition_topic(name)
              for name in ("requests-by-key", "refusals-by-key", "verdicts-by-key", "usage-by-key")}

    async def keyed(stream: Any, codec: EventCodec[Any], name: str) -> Any:
        """The stream re-keyed by API key id, decoded; history older than the windows is not behaviour now."""
        async for event in stream.group_by(key_of(codec), name=name, topic=by_key[name]).events():
            decoded: Event | None = await dead.decode(codec, event)
            at = event.message.timestamp
            if decoded is not None and time.time() - at <= max_age:
                yield decoded, at

    # Each count is read, judged and only then written: a process that dies between its alert and the suspension
    # (Cassandra down, retried until killed) has not written it, so the record, counted again after the restart,
    # crosses the threshold again. Two agents count into ``burst``; the lock makes each of their counts one step.
    burst_counting = asyncio.Lock()

    async def burst_of(key_id: str, org_id: str, tier: str, requests: int, at: float) -> None:
        limits = await granted.of(org_id, tier)
        async with burst_counting:
            before = burst[key_id].current()
            await alerter.check(Rule.REQUEST_BURST, thresholds(Rule.REQUEST_BURST, ab, limits), before,
                                before + requests, key_id=key_id, org_id=org_id, tier=tier, at_s=at)
            burst[key_id] = before + requests

    @app.agent(raw_topic(app, settings, TOPICS.requests_submitted))
    async def requests(stream: Any) -> None:
        async for request, at in keyed(stream, request_codec, "requests-by-key"):
            await burst_of(request.key_id, request.org_id, request.tier, 1, at)
            seen = list(addresses[request.key_id].current())
            if request.client_addr and request.client_addr not in seen:
                await alerter.check(Rule.MANY_ADDRESSES, thresholds(Rule.MANY_ADDRESSES, ab), len(seen),
                                    len(seen) + 1, key_id=request.key_id, org_id=request.org_id, tier=request.tier,
                                    at_s=at)
                addresses[request.key_id] = [*seen, request.client_addr][-(ab.addresses_suspend + 1):]

    @app.agent(raw_topic(app, settings, TOPICS.requests_refused))
    async def refusals(stream: Any) -> None:
        """Requests refused with 429 count towards the key's burst (``rules.py``: why a backoff never trips it)."""
        async for refused, at in keyed(stream, refused_codec, "refusals-by-key"):
            await burst_of(refused.key_id, refused.org_id, refused.tier, refused.refused, at)

    @app.agent(raw_topic(app, settings, TOPICS.verdicts))
    async def safety_violations(stream: Any) -> None:
        async for verdict, at in keyed(stream, verdict_codec, "verdicts-by-key"):
            if not verdict.blocked or not verdict.key_id:
                continue
            blocked = list(violations[verdict.key_id].current())
            # The same request's verdict again (a restart, the safety processor's): a restart's copy is stamped when
            # it is forwarded again, so it may fall in the next window; the previous window's ids count too.
            if (verdict.request_id in blocked
                    or verdict.request_id in violations[verdict.key_id].delta(ab.violations_window_s)):
                continue
            await alerter.check(Rule.SAFETY_VIOLATIONS, thresholds(Rule.SAFETY_VIOLATIONS, ab), len(blocked),
                                len(blocked) + 1, key_id=verdict.key_id, org_id=verdict.org_id or "", tier="",
                                at_s=at)
            violations[verdict.key_id] = [*blocked, verdict.request_id][-(ab.violations_suspend + 1):]

    @app.agent(raw_topic(app, settings, TOPICS.usage))
    async def token_velocity(stream: Any) -> None:
        async for usage, at in keyed(stream, usage_codec, "usage-by-key"):
            limits = await granted.of(usage.org_id, usage.tier)
            before = velocity[usage.key_id].current()
            await alerter.check(Rule.TOKEN_VELOCITY, thresholds(Rule.TOKEN_VELOCITY, ab, limits), before,
                                before + usage.completion_tokens, key_id=usage.key_id, org_id=usage.org_id,
                                tier=usage.tier, at_s=at)
            velocity[usage.key_id] = before + usage.completion_tokens

    @app.task
    async def follow_registry() -> None:
        await granted.follow()

    @app.task
    async def restore_suspensions() -> None:
        restored = await retry_transient(suspensions.sync_cache, what="suspension cache")
        log.info("suspensions restored to the cache", extra={"count": restored})

    return app
