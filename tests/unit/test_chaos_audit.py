"""The chaos audit can fail: a healthy run meets its goals, and each kind of broken run misses the goal it breaks
(issue 38: a run in which the fault missed, or the audit read nothing, fails)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from decimal import Decimal

import pytest

from bench.chaos.audit import Evidence, Expectation, Turns, judge
from bench.chaos.client import Stream
from billing.ledger import LedgerRow
from inference_workers.synthetic import expected_completion, token_text
from schemas.events import ChatRequest, TokenEvent, utcnow
from tests.fakes.worker import request as make_request

FAULT_US = 5_000_000  # the fault begins 5 s after the epoch of this fake run
STEP_US = 100_000


def _events(request: ChatRequest, *, attempts: tuple[int, ...] = (1,), start_us: int = 4_000_000
            ) -> list[TokenEvent]:
    """The request's token events: one token per event, the last attempt writing the final; with two attempts the
    second takes over at the middle."""
    ids, _ = expected_completion(request.prompt_token_ids, request.sampling)
    cut = len(ids) // 2 if len(attempts) > 1 else len(ids)
    events = []
    for n, token in enumerate(ids):
        attempt = attempts[0] if n < cut else attempts[-1]
        events.append(TokenEvent(request_id=request.request_id, attempt=attempt, seq=n, token_offset=n,
                                 token_ids=[token], text=token_text(token), worker_id="w",
                                 emitted_at_us=start_us + n * STEP_US))
    events.append(TokenEvent(request_id=request.request_id, attempt=attempts[-1], seq=len(ids),
                             token_offset=len(ids), token_ids=[], text="", finish_reason="length", worker_id="w",
                             emitted_at_us=start_us + len(ids) * STEP_US))
    return events


def _stream(index: int, request: ChatRequest) -> Stream:
    _, text = expected_completion(request.prompt_token_ids, request.sampling)
    return Stream(index, "p", request.sampling.max_tokens, request_id=request.request_id, status=200,
                  finish_reason="length", done=True, text=text)


def _row(request: ChatRequest, completion: int) -> LedgerRow:
    return LedgerRow(request_id=request.request_id, org_id="org", key_id="key", tier="pro", model="m",
                     prompt_tokens=len(request.prompt_token_ids), completion_tokens=completion, cached_tokens=0,
                     cost=Decimal("0.000001"), price_version="v1", finish_reason="length", attempt=1,
                     requested_at=request.created_at, finished_at=request.created_at)


def healthy(expectation: Expectation | None = None, n: int = 4) -> Evidence:
    """Four streams, each hit by the fault mid-generation, the first taken over; all received and billed exactly."""
    requests = [make_request(max_tokens=20, prompt=[i + 1, 2, 3]) for i in range(n)]
    return Evidence(
        "fake", [_stream(i, r) for i, r in enumerate(requests)],
        expectation or Expectation(min_taken_over=1),
        started_at=utcnow() - timedelta(minutes=1), fault_at=FAULT_US / 1e6,
        requests={r.request_id: r for r in requests},
        tokens={r.request_id: _events(r, attempts=(1, 2) if i == 0 else (1,)) for i, r in enumerate(requests)},
        ledger=[_row(r, 20) for r in requests], usage_records=Counter(r.request_id for r in requests))


def test_a_healthy_run_meets_every_goal() -> None:
    table = judge(healthy())
    assert table.goals_met, table.missed
    assert (table.streams_audited, table.hit_mid_generation, table.taken_over) == (4, 4, 1)


def _lose_a_token(e: Evidence) -> None:
    s = e.streams[1]
    s.text = s.text.replace(token_text(int(s.text.split(" t")[5])), "", 1)


def _duplicate_a_token(e: Evidence) -> None:
    s = e.streams[1]
    first = " t" + s.text.split(" t")[1]
    s.text = first + s.text


def _splice(e: Evidence) -> None:
    other = e.streams[2].text
    s = e.streams[1]
    s.text = s.text[: len(s.text) // 2] + other[len(other) // 2:]


def _never_end(e: Evidence) -> None:
    e.streams[1].done = False


def _bill_a_row_too_many(e: Evidence) -> None:
    stranger = make_request(max_tokens=20)
    e.ledger.append(_row(stranger, 20))


def _bill_beyond_delivery(e: Evidence) -> None:
    e.ledger[1] = replace(e.ledger[1], completion_tokens=21)


def _bill_short(e: Evidence) -> None:
    e.ledger[1] = replace(e.ledger[1], completion_tokens=19)


def _leave_one_unbilled(e: Evidence) -> None:
    e.ledger.pop(1)


def _record_usage_twice(e: Evidence) -> None:
    e.usage_records[e.streams[1].request_id or ""] += 1


def _fault_misses_every_stream(e: Evidence) -> None:
    e.fault_at = 60.0  # long after every generation ended


def _nothing_taken_over(e: Evidence) -> None:
    e.tokens = {r: [ev.model_copy(update={"attempt": 1}) for ev in events] for r, events in e.tokens.items()}


def _request_records_unread(e: Evidence) -> None:
    e.requests = {}  # a read of the wrong topic, namespace or isolation: nothing to audit against


def _token_log_unread(e: Evidence) -> None:
    e.tokens = {}  # the log read from the wrong partition or offset: no hit, no regeneration, nothing for nobody


def _nobody_resumed(e: Evidence) -> None:
    e.expectation = replace(e.expectation, min_resumed=1)  # the healthy run's clients never reconnected


def _a_failure_not_allowed(e: Evidence) -> None:
    e.streams[1].error = "stream timeout"


def _ledger_disagrees_with_the_log(e: Evidence) -> None:
    e.discrepancies = ["missing chatcmpl-x: no ledger row"]


def _a_turn_misrecorded(e: Evidence) -> None:
    e.turns = Turns(4, {"conv_1": "3 items, 2 expected"})


def _spend_differs(e: Evidence) -> None:
    e.spend_minus_ledger_nanos = 1


BROKEN: dict[str, tuple[Callable[[Evidence], None], str]] = {
    "a lost token": (_lose_a_token, "no token lost"),
    "a duplicate": (_duplicate_a_token, "no token duplicated"),
    "a splice": (_splice, "no stream spliced"),
    "a stream that never ends": (_never_end, "no failure but"),
    "a ledger row too many": (_bill_a_row_too_many, "nobody billed beyond what they received"),
    "billed beyond delivery": (_bill_beyond_delivery, "nobody billed beyond what they received"),
    "billed short": (_bill_short, "every received token billed"),
    "a stream not billed": (_leave_one_unbilled, "every received token billed"),
    "usage recorded twice": (_record_usage_twice, "no request with two usage records"),
    "a fault that hit nothing": (_fault_misses_every_stream, "the fault hit at least"),
    "a failover that never ran": (_nothing_taken_over, "at least 1 requests taken over"),
    "an audit that read nothing": (_request_records_unread, "every accepted stream audited"),
    "a token log read that found nothing": (_token_log_unread, "every stream whose client received tokens found"),
    "no client resumed": (_nobody_resumed, "at least 1 streams resumed by their clients"),
    "a failure the scenario does not allow": (_a_failure_not_allowed, "no failure but"),
    "a ledger unlike the usage log": (_ledger_disagrees_with_the_log, "the ledger equals the usage log"),
    "a turn misrecorded": (_a_turn_misrecorded, "every answered turn in its conversation once"),
    "a spend unlike the ledger": (_spend_differs, "the org's spend equals its ledger"),
}


@pytest.mark.parametrize("kind", list(BROKEN))
def test_a_broken_run_misses_the_goal_it_breaks(kind: str) -> None:
    breaks, goal = BROKEN[kind]
    evidence = healthy()
    breaks(evidence)
    table = judge(evidence)
    assert not table.goals_met
    assert any(m.startswith(goal) for m in table.missed), table.missed


def test_designed_failures_are_allowed_but_must_happen() -> None:
    storm = Expectation(allowed_failures=frozenset({"stream timeout"}), must_fail=True, min_hit=0,
                        min_completed_share=0.0, min_completed=2)
    evidence = healthy(storm)
    assert any(m.startswith("the scenario's designed failures happened") for m in judge(evidence).missed)
    evidence.streams[3].error = "stream timeout"
    evidence.streams[3].text = ""  # timed out before its first token: nothing received, nothing billed
    evidence.ledger.pop(3)
    evidence.tokens.pop(evidence.streams[3].request_id or "")
    assert judge(evidence).goals_met, judge(evidence).missed


def test_tokens_generated_for_a_client_that_gave_up_are_counted() -> None:
    storm = Expectation(allowed_failures=frozenset({"stream timeout"}), min_hit=0, min_completed_share=0.0)
    evidence = healthy(storm)
    gone = evidence.streams[3]
    gone.error, gone.text = "stream timeout", ""  # its client got nothing, but the log holds its 20 tokens
    evidence.ledger.pop(3)
    table = judge(evidence)
    assert table.generated_for_nobody == 20
    assert any(m.startswith("at most 0 tokens generated for nobody") for m in table.missed)


def test_a_refusal_before_acceptance_is_not_audited_and_only_passes_when_allowed() -> None:
    evidence = healthy(Expectation(min_completed_share=0.5))
    evidence.streams.append(Stream(4, "p", 20, status=503, error="503 service_unavailable", done=True))
    table = judge(evidence)
    assert table.refused == 1 and table.streams_audited == 4
    assert table.failed == {"refused 503 service_unavailable": 1} and not table.goals_met
    evidence.expectation = Expectation(allowed_failures=frozenset({"refused 503 service_unavailable"}),
                                       min_completed_share=0.5)
    assert judge(evidence).goals_met


def test_with_the_real_model_billing_is_checked_against_the_clients_own_count() -> None:
    """The client's count comes from its text (tokenized), not from the usage chunk the worker sent."""
    evidence = healthy(Expectation(min_taken_over=0))
    evidence.synthetic = False
    evidence.reference = [s.text for s in evidence.streams]
    evidence.client_tokens = {s.request_id or "": 20 for s in evidence.streams}
    for s in evidence.streams:
        s.usage = {"completion_tokens": 25}  # what the server claims: must not matter
    assert judge(evidence).goals_met, judge(evidence).missed
    evidence.client_tokens[evidence.streams[0].request_id or ""] = 18
    assert any(m.startswith("nobody billed beyond") for m in judge(evidence).missed)


def test_with_the_real_model_a_stream_without_a_reference_fails_the_audit() -> None:
    evidence = healthy(Expectation(min_taken_over=0))
    evidence.synthetic = False
    evidence.reference = [s.text for s in evidence.streams][:3]
    evidence.client_tokens = {s.request_id or "": 20 for s in evidence.streams}
    table = judge(evidence)
    assert table.streams_unaudited == 1
    assert any(m.startswith("every accepted stream audited") for m in table.missed)


def test_an_abandoned_stream_is_billed_what_the_log_holds_within_the_scenarios_bound_and_no_more() -> None:
    """A client that dropped and never came back is billed what the log holds (``listeners.py``: any client of the
    stream can read it), a few tokens beyond what it read; more than the log holds is billed for nobody."""
    drops = Expectation(allowed_failures=frozenset({"abandoned"}), min_completed_share=0.5, min_taken_over=1,
                        max_generated_for_nobody=2)
    evidence = healthy(drops)
    gone = evidence.streams[3]
    gone.abandoned, gone.done = True, False
    gone.text = "".join(token_text(int(t)) for t in gone.text.split(" t")[1:11])  # it read 10 of the 20
    log = evidence.tokens[gone.request_id or ""]
    evidence.tokens[gone.request_id or ""] = [e for e in log if e.token_offset < 12]  # suspended 2 tokens later
    evidence.ledger[3] = replace(evidence.ledger[3], completion_tokens=12, finish_reason="cancelled")
    assert judge(evidence).goals_met, judge(evidence).missed
    evidence.ledger[3] = replace(evidence.ledger[3], completion_tokens=13)
    assert any(m.startswith("nobody billed beyond") for m in judge(evidence).missed)
    evidence.ledger[3] = replace(evidence.ledger[3], completion_tokens=12)
    evidence.tokens[gone.request_id or ""] = log  # generated to its end for nobody: its window never ended
    evidence.ledger[3] = replace(evidence.ledger[3], completion_tokens=20)
    assert any(m.startswith("at most 2 tokens generated for nobody") for m in judge(evidence).missed)
