"""Abuse thresholds per tier, crossing detection, deterministic alert ids."""

from __future__ import annotations

import os
import subprocess
import sys

from runtime.settings import REPO_ROOT, AbuseSettings, TierTable
from schemas.events import AbuseAction
from stream_processors.abuse.rules import Rule, alert_id, decide, thresholds, window_start

SETTINGS = AbuseSettings()
TIERS = TierTable.model_validate({})


def test_burst_thresholds_scale_with_the_tier() -> None:
    free = thresholds(Rule.REQUEST_BURST, "free", SETTINGS, TIERS)
    plus = thresholds(Rule.REQUEST_BURST, "plus", SETTINGS, TIERS)
    # free: 30 rpm → 5 per 10 s window; flagged at 3x (15), suspended at 2x that (30)
    assert (free.flag, free.suspend, free.window_s) == (15, 30, 10)
    assert plus.flag == 20 * free.flag
    assert thresholds(Rule.REQUEST_BURST, "no-such-tier", SETTINGS, TIERS) == free


def test_a_rule_fires_once_when_a_count_crosses_its_threshold() -> None:
    t = thresholds(Rule.REQUEST_BURST, "free", SETTINGS, TIERS)
    decisions = [decide(n - 1, n, t) for n in range(1, 41)]
    assert decisions.count(AbuseAction.FLAG) == 1 and decisions[14] is AbuseAction.FLAG
    assert decisions.count(AbuseAction.SUSPEND) == 1 and decisions[29] is AbuseAction.SUSPEND
    # a jump over both thresholds at once suspends
    assert decide(0, 100, t) is AbuseAction.SUSPEND


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
