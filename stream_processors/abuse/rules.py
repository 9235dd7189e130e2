"""Abuse rules: thresholds from the limits a key's org is granted, and the decision to flag or suspend. Pure
functions, no I/O.

The rate rules compare a window's count with what the limiter (``runtime/limiter.py``, token buckets of one
minute's capacity) can admit within that window: a full bucket plus the window's refill. A key that stays within
its org's limits (its tier's, or the org's own overrides) therefore never reaches a threshold, whatever its burst.
A request burst counts the requests refused with 429 too: hammering through refusals is the signal, while a client
that retries only when Retry-After says makes at most one refusal per admission, at most twice the allowance.

Counts live in windowed tables (at least once: ``processor.py``); a rule fires when a count *crosses* a threshold,
so each (rule, key, window) raises at most one FLAG and one SUSPEND, and replays raise the same alert ids.
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass

from runtime.limiter import Limits
from runtime.settings import AbuseSettings
from schemas.events import AbuseAction


class Rule(enum.StrEnum):
    REQUEST_BURST = "request_burst"
    SAFETY_VIOLATIONS = "safety_violations"
    TOKEN_VELOCITY = "token_velocity"
    MANY_ADDRESSES = "many_addresses"


@dataclass(frozen=True)
class Thresholds:
    flag: float
    suspend: float
    window_s: float


def allowance(per_minute: int, window_s: float) -> float:
    """The most a token bucket of ``per_minute`` (capacity: one minute's worth) admits within ``window_s``."""
    return per_minute * (1 + window_s / 60)


def thresholds(rule: Rule, settings: AbuseSettings, limits: Limits | None = None) -> Thresholds:
    """``limits``: the key's org's effective limits (the rate rules need them)."""
    if rule is Rule.SAFETY_VIOLATIONS:
        return Thresholds(settings.violations_flag, settings.violations_suspend, settings.violations_window_s)
    if rule is Rule.MANY_ADDRESSES:
        return Thresholds(settings.addresses_flag, settings.addresses_suspend, settings.addresses_window_s)
    if limits is None:
        raise ValueError(f"the {rule} thresholds need the key's limits")
    if rule is Rule.REQUEST_BURST:
        rate, window_s, factor = limits.requests_per_minute, settings.burst_window_s, settings.burst_factor
    else:
        rate, window_s, factor = limits.tokens_per_minute, settings.velocity_window_s, settings.velocity_factor
    flag = allowance(rate, window_s) * factor
    return Thresholds(flag, flag * settings.suspend_factor, window_s)


def decide(before: float, after: float, t: Thresholds) -> AbuseAction | None:
    """What the step from ``before`` to ``after`` calls for (None: nothing new)."""
    if before < t.suspend <= after:
        return AbuseAction.SUSPEND
    if before < t.flag <= after:
        return AbuseAction.FLAG
    return None


def window_start(timestamp_s: float, window_s: float) -> float:
    return timestamp_s - timestamp_s % window_s


def alert_id(rule: Rule, key_id: str, window_start_s: float, action: AbuseAction) -> str:
    return hashlib.sha1(f"{rule}|{key_id}|{window_start_s:.0f}|{action}".encode()).hexdigest()[:20]
