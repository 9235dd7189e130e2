"""A restart's recount of safety violations when Faust forwards the uncommitted source records again.

``keyed`` windows each record by the time of its *re-keyed* record (``event.message.timestamp`` of the
``group_by`` repartition topic), and Faust's ``group_by`` forwards with no timestamp (``Event.forward`` ->
``timestamp=None``): Kafka stamps the copy with the time it is forwarded. A restart forwards again the source records
its group had not committed, so a verdict processed just before a window's end is counted again in the *next*
window, whose list of blocked request ids does not hold it. ``processor.py`` says violations are distinct ids, "so
counting a record again changes nothing", and PROCESSORS.md that a recount never suspends a key.
"""

from __future__ import annotations

import time

from schemas.events import AbuseAction
from tests.unit.test_abuse_restarts import KEY, Alerts, Changelog, Detector, Record, Suspensions, blocked
from tests.unit.test_abuse_restarts import world as world  # the fixture

WINDOW_S = 600  # ``violations_window_s``; flagged at 3, suspended at 6


async def test_blocked_requests_forwarded_again_into_the_next_window_after_a_restart_do_not_suspend_the_key(
        world: tuple[Changelog, Suspensions, Alerts]) -> None:
    changelog, suspensions, alerts = world
    boundary = time.time() // WINDOW_S * WINDOW_S  # the current window's start
    before, after = boundary - 2, boundary + 3  # the last seconds of one window, the first of the next
    first = [Record(blocked(i), before, offset=i) for i in range(5)]
    await Detector(changelog).count("safety_violations", first)
    assert [a.action for a in alerts.sent] == [AbuseAction.FLAG]

    # Killed before its group committed the source offsets: the next process forwards the same 5 verdicts again,
    # Kafka stamps the copies now (the next window), and one new request of the key is blocked there.
    again = [Record(blocked(i), after, offset=5 + i) for i in range(5)]
    await Detector(changelog).count("safety_violations", [*again, Record(blocked(5), after, offset=10)])

    # Without the restart the key had 5 blocked requests in one window and 1 in the next: flagged, not suspended.
    assert KEY not in suspensions.suspended, "a restart's recount of 5 blocked requests suspended the key"
