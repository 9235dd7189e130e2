"""``kns bench flood``'s pure parts: the bound, the attacker's requests and how its answers are counted."""

from __future__ import annotations

import orjson

from bench.flood_clients import CREATE_ITEMS, KINDS, REFUSED_IN_A_ROW, Tally, Targets, requests_of
from bench.tenant_flood import answers, bound, phase_name

BASE = "http://127.0.0.1:9/v1"


def test_the_bound_allows_the_larger_of_a_share_and_a_floor() -> None:
    alone = [[0.1] * 100]
    assert bound(alone, [[0.14] * 100], share=0.25, floor_s=0.05)["holds"]  # +40 ms: under the 50 ms floor
    assert not bound(alone, [[0.16] * 100], share=0.25, floor_s=0.05)["holds"]
    slow = [[1.0] * 100]
    assert bound(slow, [[1.2] * 100], share=0.25, floor_s=0.05)["holds"]  # +200 ms: under 25 % of 1 s
    assert not bound(slow, [[1.3] * 100], share=0.25, floor_s=0.05)["holds"]


def test_the_bound_takes_the_median_move_of_the_rounds() -> None:
    alone = [[0.1] * 100, [0.1] * 100, [0.1] * 100]
    disturbed = [[0.12] * 100, [0.9] * 100, [0.13] * 100]  # one round slowed by other work on the machine
    check = bound(alone, disturbed, share=0.25, floor_s=0.05)
    assert check["holds"] and check["moved_s"] == 0.03 and check["moved_by_round_s"] == [0.02, 0.8, 0.03]
    assert not bound(alone, [[0.2] * 100, [0.9] * 100, [0.13] * 100], share=0.25, floor_s=0.05)["holds"]


def test_the_bound_does_not_hold_without_figures() -> None:
    assert not bound([], [])["holds"] and not bound([[0.1]], [[]])["holds"]


def test_each_kind_is_one_well_formed_request_of_the_attackers_key() -> None:
    requests = requests_of(BASE, "sk-attacker", Targets(["chatcmpl-a", "chatcmpl-b"], ["chatcmpl-old"], "conv_1"))
    assert set(requests) == set(KINDS)
    assert len(requests["resume recent"]) == 2 and len(requests["resume far"]) == 1
    for sent in requests.values():
        for request in sent:
            head, _, body = request.partition(b"\r\n\r\n")
            assert b"Authorization: Bearer sk-attacker" in head
            assert f"Content-Length: {len(body)}".encode() in head
    resume = requests["resume far"][0]
    assert resume.startswith(b"GET /v1/chat/completions/chatcmpl-old?stream=true&starting_after=0 HTTP/1.1\r\n")
    create = orjson.loads(requests["create conversation"][0].partition(b"\r\n\r\n")[2])
    assert len(create["items"]) == CREATE_ITEMS
    assert b"/v1/usage?start=" in requests["usage 93 days"][0]


def test_answers_are_counted_by_outcome_and_the_buckets_found_empty() -> None:
    tally = Tally()
    tally.add("list items", "200", 0.01)
    tally.add("resume far", "429", 0.001)
    tally.add("resume far", "409", 0.001)
    tally.add("create conversation", "429", 0.001)
    counted = tally.as_json(2.0)
    assert answers(counted) == {"admitted": 1, "429": 2, "other": 1}
    assert counted["resume far"]["sent"] == 2 and counted["resume far"]["per_s"] == 1.0
    assert not tally.drained()
    for _ in range(REFUSED_IN_A_ROW):
        tally.add("list conversations", "429", 0.001)
    assert not tally.drained()  # its writes are still admitted
    for _ in range(REFUSED_IN_A_ROW):
        tally.add("update metadata", "429", 0.001)
    assert tally.drained()
    tally.add("update metadata", "200", 0.01)
    assert not tally.drained()


def test_a_phase_is_named_by_its_attackers_tier_and_rate() -> None:
    assert [phase_name(f) for f in (None, ("plus", 300.0), ("free", 0.0))] == ["alone", "plus 300/s", "free max"]
