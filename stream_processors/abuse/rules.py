"""Abuse rules: thresholds per tier and the decision to flag or suspend. Pure functions, no I/O.

Counts live in windowed tables (exact under Faust's exactly-once); a rule fires when a count *crosses* a threshold,
so each (rule, key, window) raises at most one FLAG and one SUSPEND, and replays raise the same alert ids.
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass

from runtime.settings import AbuseSettings, TierTable
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


def thresholds(rule: Rule, tier: str, settings: AbuseSettings, tiers: TierTable) -> Thresholds:
    limit = tiers.policy(tier)
    if rule is Rule.REQUEST_BURST:
        flag = limit.requests_per_minute * settings.burst_window_s / 60 * settings.burst_factor
        return Thresholds(flag, flag * settings.suspend_factor, settings.burst_window_s)
    if rule is Rule.TOKEN_VELOCITY:
        flag = limit.tokens_per_minute * settings.velocity_window_s / 60 * settings.velocity_factor
        return Thresholds(flag, flag * settings.suspend_factor, settings.velocity_window_s)
    if rule is Rule.SAFETY_VIOLATIONS:
        return Thresholds(settings.violations_flag, settings.violations_suspend, settings.violations_window_s)
    return Thresholds(settings.addresses_flag, settings.addresses_suspend, settings.addresses_window_s)


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
