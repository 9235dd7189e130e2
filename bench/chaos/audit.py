"""What a chaos run did to its streams and its bill, from the client's view, the event log and the ledger, held to
what its scenario promises.

Two steps. :func:`gather` reads everything the run left once (the streams as each client received them, the
request records, every token event, the usage log and the ledger) into :class:`Evidence`; :func:`judge`, a pure
function of that evidence and the scenario's :class:`Expectation`, counts and decides. The judge is what the
tests feed broken runs to: each goal below can fail.

Per accepted stream, the text the client received is compared token by token with what an uninterrupted
generation of the synthetic model gives for the same prompt (read back from the request topic): tokens received
twice (duplicated), tokens missing from a stream that claims to be complete (lost), streams that are not one
generation's text at all (spliced). With the real model (``--engine vllm``) the same prompts are first run without
a fault and each stream's text is compared with that reference. A stream that cannot be audited so (its request
record or reference is missing) fails the run: a broken read must not read as "nothing lost".

The token log says whether the fault touched anything: streams hit mid-generation (their first token before the
fault began, their last event after it), requests continued by another attempt (taken over), token positions
produced twice. A run whose fault missed every stream fails.

Billing: the ledger is reconciled against a replay of the usage topic (ledger minus replay); a request with two
committed usage records is billed twice in the log; and every billed row is checked against what its client
received, counted on the client side (synthetic tokens in the text; with the real model the received text
tokenized with the model's own tokenizer), never against the server's usage chunk.
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from bench.chaos.client import Stream
from bench.common import percentiles
from billing.ledger import Ledger, LedgerRow, utc
from billing.prices import PriceLead, PriceStore
from billing.reconcile import reconcile
from billing.replay import replay_usage
from inference_workers.synthetic import expected_completion
from runtime.cassandra_client import connect_async
from runtime.kafka_clients import read_to_end
from runtime.redis_client import make_redis
from runtime.settings import KafkaSettings, RedisSettings, Settings
from runtime.spend import SpendBook, ledger_nanos, month_of, usd
from schemas.codec import codec_for
from schemas.events import ChatRequest, TokenEvent
from schemas.topics import TOPICS

TOKEN = re.compile(r" t(\d+)")
#: a stream silent for longer than this was slowed by the fault (synthetic tokens come every 50 ms)
AFFECTED_S = 1.0
#: outcomes that are never a clear answer, whatever the scenario
NEVER_ALLOWED = ("no [DONE]", "connection")


@dataclass(frozen=True)
class Expectation:
    """What a scenario promises about its run; :func:`judge` holds the run to it."""

    #: the only ways a stream may end other than completed (``Stream.outcome``: "refused 503 service_unavailable" is
    #: a request refused before it was accepted, "stream timeout" an SSE error event with code ``timeout``, ...)
    allowed_failures: frozenset[str] = frozenset()
    #: the share of streams that must complete (1.0: every one), and at least this many
    min_completed_share: float = 1.0
    min_completed: int = 1
    #: the scenario's designed failures must be seen (a timeout storm that timed nothing out missed)
    must_fail: bool = False
    #: streams the fault must hit mid-generation: their first token before the fault began, their last event after
    min_hit: int = 1
    #: requests another attempt must have continued (the failover path ran)
    min_taken_over: int = 0
    #: streams whose client must have resumed on another connection
    min_resumed: int = 0
    #: tokens the log holds beyond what failed streams' clients received (generated for nobody)
    max_generated_for_nobody: int = 0

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "allowed_failures": sorted(self.allowed_failures)}


@dataclass
class Turns:
    """The conversation writer's audit: turns checked, and those whose conversation does not hold exactly their
    input and their answer once."""

    checked: int = 0
    misrecorded: dict[str, str] = field(default_factory=dict)


@dataclass
class Evidence:
    """Everything a run left, read once."""

    scenario: str
    streams: list[Stream]
    expectation: Expectation
    #: when the load started, and when the fault began (Unix seconds; None: no single moment, e.g. an armed fault)
    started_at: datetime
    fault_at: float | None = None
    synthetic: bool = True
    #: the request records found in the work queues, by request id
    requests: dict[str, ChatRequest] = field(default_factory=dict)
    #: each request's token events (deltas and finals, every attempt's, committed or not), in log order
    tokens: dict[str, list[TokenEvent]] = field(default_factory=dict)
    #: the real model: each stream's text in a run without the fault, by stream index
    reference: list[str] | None = None
    #: the real model: completion tokens in the text each client received, by request id (the model's tokenizer)
    client_tokens: dict[str, int] = field(default_factory=dict)
    #: the org's billed rows of the run (``ledger_by_request``), and its committed usage records per request id
    ledger: list[LedgerRow] = field(default_factory=list)
    usage_records: Counter[str] = field(default_factory=Counter)
    #: reconcile's discrepancies between the ledger and a replay of the usage log
    discrepancies: list[str] = field(default_factory=list)
    #: the org's spend as admission sees it minus the ledger's sum (nano-dollars), and whether Redis was wiped
    spend_minus_ledger_nanos: int = 0
    spend_wiped: bool = False
    turns: Turns | None = None


@dataclass
class TokenCheck:
    duplicated: int = 0
    lost: int = 0
    spliced: bool = False


def check_tokens(received: list[int], expected: list[int], *, complete: bool) -> TokenCheck:
    """Align what the client received with the uninterrupted generation."""
    check = TokenCheck()
    i = j = 0
    while i < len(received):
        if j < len(expected) and received[i] == expected[j]:
            i, j = i + 1, j + 1
        elif received[i] in expected[max(0, j - 64):j]:  # a token the client already had, again
            check.duplicated += 1
            i += 1
        elif received[i] in expected[j:j + 64]:  # tokens skipped
            gap = expected[j:j + 64].index(received[i])
            check.lost += gap
            j += gap
        else:
            check.spliced = True
            return check
    if complete:
        check.lost += len(expected) - j
    return check


@dataclass
class Table:
    scenario: str
    sent: int = 0
    completed: int = 0
    failed: dict[str, int] = field(default_factory=dict)
    #: streams refused before they were accepted (no request id: nothing to audit but the refusal)
    refused: int = 0
    #: accepted streams checked token by token (or against the reference text), and those that could not be
    streams_audited: int = 0
    streams_unaudited: int = 0
    tokens_duplicated: int = 0
    tokens_lost: int = 0
    spliced_streams: int = 0
    #: streams whose client received tokens the token log does not hold (a read of the log that found nothing, or
    #: part of a stream, would otherwise pass every goal counted from it: generated twice or for nobody)
    streams_not_in_log: int = 0
    #: streams whose generation spanned the fault's start (token log)
    hit_mid_generation: int = 0
    #: token positions some worker produced more than once (zombies, regenerations from scratch)
    tokens_generated_twice: int = 0
    #: tokens the log holds beyond what the clients of failed streams received
    generated_for_nobody: int = 0
    #: requests continued by another attempt (the failover path)
    taken_over: int = 0
    affected_streams: int = 0
    recover_s: dict[str, float | None] = field(default_factory=dict)
    #: streams whose client reconnected to another gateway and got the rest (Last-Event-ID), and the time from the
    #: last chunk before the break to the first one after it
    resumed_streams: int = 0
    resume_gap_s: dict[str, float | None] = field(default_factory=dict)
    ledger_minus_replay: int = 0
    #: requests with more than one committed usage record (billed twice in the log)
    usage_recorded_twice: int = 0
    billed_for_nobody: int = 0
    #: tokens a client received that its bill does not count (or a bill missing for a stream that got tokens)
    billed_short: int = 0
    #: the org's spend as admission sees it (Redis) minus the ledger's sum, in USD; after a scenario that wipes Redis
    #: it is what ``kns billing spend --repair`` restores, and does not count against the goals
    spend_minus_ledger_usd: str = "0"
    spend_wiped: bool = False
    #: a load of conversations: the turns checked, and those whose conversation does not hold exactly their input
    #: and their answer once (the conversation writer's audit)
    turns_checked: int = 0
    turns_misrecorded: int = 0
    expected: dict[str, Any] = field(default_factory=dict)
    #: each goal the run missed, with what was seen (empty: every goal met)
    missed: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def goals_met(self) -> bool:
        return not self.missed

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "goals_met": self.goals_met}


# --- the judge ------------------------------------------------------------------------------------------------


def judge(evidence: Evidence) -> Table:
    """Count what the run did and hold it to its scenario's expectation (pure: no I/O)."""
    streams, want = evidence.streams, evidence.expectation
    table = Table(evidence.scenario, sent=len(streams), expected=want.as_json())
    outcomes = Counter(s.outcome for s in streams)
    table.completed = outcomes.pop("completed", 0)
    table.failed = dict(outcomes)
    table.refused = sum(1 for s in streams if s.refused)
    received = {s.request_id: _received(evidence, s) for s in streams if s.request_id}
    _audit_streams(table, evidence)
    in_log = _audit_log(table, evidence, received)
    table.streams_not_in_log = sum(1 for r, got in received.items()
                                   if got > 0 and _short_in_log(evidence, r, got, in_log))
    # What a stream is billed: what its client received; for one that did not complete, what the log holds (any
    # client of the stream may still read it: the billing rule of ``inference_workers/listeners.py``), whose excess
    # over what it received is the scenario's bounded ``generated_for_nobody``
    completed = {s.request_id for s in streams if s.completed}
    billable = {r: got if r in completed else max(got, in_log.get(r, 0)) for r, got in received.items()}
    _audit_billing(table, evidence, billable)
    if evidence.turns is not None:
        table.turns_checked = evidence.turns.checked
        table.turns_misrecorded = len(evidence.turns.misrecorded)
        table.notes += [f"conversation {c}: {why}" for c, why in list(evidence.turns.misrecorded.items())[:5]]
    table.spend_wiped = evidence.spend_wiped
    table.spend_minus_ledger_usd = str(usd(evidence.spend_minus_ledger_nanos))
    table.missed = _missed(table, want)
    return table


def _received(evidence: Evidence, stream: Stream) -> int:
    """Completion tokens this stream's client received, counted on the client's side."""
    if evidence.synthetic:
        return len(TOKEN.findall(stream.text))
    return evidence.client_tokens.get(stream.request_id or "", 0)


def _audit_streams(table: Table, evidence: Evidence) -> None:
    for stream in evidence.streams:
        if stream.refused:
            continue
        if not evidence.synthetic:
            reference = evidence.reference or []
            if stream.index >= len(reference):
                table.streams_unaudited += 1
                table.notes.append(f"stream {stream.index}: no reference text to audit it against")
                continue
            want = reference[stream.index]
            table.streams_audited += 1
            table.spliced_streams += int(stream.text != want if stream.completed else not want.startswith(stream.text))
            continue
        request = evidence.requests.get(stream.request_id or "")
        if request is None:
            table.streams_unaudited += 1
            table.notes.append(f"stream {stream.index} ({stream.request_id}): its request record was not found")
            continue
        expected, _ = expected_completion(request.prompt_token_ids, request.sampling)
        check = check_tokens([int(t) for t in TOKEN.findall(stream.text)], expected, complete=stream.completed)
        table.streams_audited += 1
        table.tokens_duplicated += check.duplicated
        table.tokens_lost += check.lost
        table.spliced_streams += int(check.spliced)
    silences = [s.longest_silence() for s in evidence.streams if s.longest_silence() > AFFECTED_S]
    table.affected_streams = len(silences)
    table.recover_s = {k: v for k, v in percentiles(silences).items() if k in ("p50", "p99")}
    table.resumed_streams = sum(1 for s in evidence.streams if s.resumes)
    gaps = [g for s in evidence.streams for g in s.resume_gaps]
    table.resume_gap_s = {k: v for k, v in percentiles(gaps).items() if k in ("p50", "p99")}


def _audit_log(table: Table, evidence: Evidence, received: dict[str, int]) -> dict[str, int]:
    """The token log's counts; returns the tokens each request has in the log (distinct positions)."""
    fault_us = None if evidence.fault_at is None else int(evidence.fault_at * 1_000_000)
    failed = {s.request_id for s in evidence.streams if s.request_id and not s.completed}
    in_log: dict[str, int] = {}
    for request_id, events in evidence.tokens.items():
        covered = Counter(e.token_offset + k for e in events for k in range(len(e.token_ids)))
        in_log[request_id] = len(covered)
        table.tokens_generated_twice += sum(n - 1 for n in covered.values() if n > 1)
        table.taken_over += int(len({e.attempt for e in events}) > 1)
        if fault_us is not None and _spans(events, fault_us):
            table.hit_mid_generation += 1
        if request_id in failed:
            table.generated_for_nobody += max(0, len(covered) - received.get(request_id, 0))
    return in_log


def _short_in_log(evidence: Evidence, request_id: str, received: int, in_log: dict[str, int]) -> bool:
    """The token log holds less of the stream than its client received: with the synthetic engine a client can
    only receive what the log holds (token for token); the real model's client count is its text tokenized again,
    which may differ from the generated ids by a few, so there only a stream absent from the log counts."""
    if evidence.synthetic:
        return in_log.get(request_id, 0) < received
    return not evidence.tokens.get(request_id)


def _spans(events: list[TokenEvent], moment_us: int) -> bool:
    """A generation under way at ``moment_us``: a token out before it, and more of the stream after it."""
    first_token = min((e.emitted_at_us for e in events if e.token_ids), default=None)
    return first_token is not None and first_token < moment_us < max(e.emitted_at_us for e in events)


def _audit_billing(table: Table, evidence: Evidence, received: dict[str, int]) -> None:
    table.ledger_minus_replay = len(evidence.discrepancies)
    table.notes += evidence.discrepancies[:5]
    table.usage_recorded_twice = sum(1 for n in evidence.usage_records.values() if n > 1)
    table.notes += [f"usage recorded {n} times: {r}" for r, n in evidence.usage_records.items() if n > 1][:5]
    by_request = {s.request_id: s for s in evidence.streams if s.request_id}
    billed: set[str] = set()
    for row in evidence.ledger:
        if utc(row.requested_at) < evidence.started_at:
            continue  # a reference pass before the fault (``--engine vllm``): delivered, not audited here
        billed.add(row.request_id)
        stream = by_request.get(row.request_id)
        got = received.get(row.request_id, 0)
        nothing = got == 0 and (stream is None or not stream.completed)
        if row.completion_tokens > got or (row.prompt_tokens > 0 and nothing):
            table.billed_for_nobody += 1
            table.notes.append(f"billed beyond delivery {row.request_id}: billed {row.prompt_tokens} + "
                               f"{row.completion_tokens}, received {got}")
        elif row.completion_tokens < got:
            table.billed_short += got - row.completion_tokens
            table.notes.append(f"billed short {row.request_id}: billed {row.completion_tokens}, received {got}")
    for request_id, got in received.items():
        if got and request_id not in billed:
            table.billed_short += got
            table.notes.append(f"not billed {request_id}: received {got} tokens")


def _missed(t: Table, want: Expectation) -> list[str]:
    """Every goal the run did not meet, with what was seen."""
    failures = {outcome: n for outcome, n in t.failed.items()
                if outcome not in want.allowed_failures or outcome.startswith(NEVER_ALLOWED)}
    needed = max(want.min_completed, math.ceil(want.min_completed_share * t.sent))
    goals: list[tuple[bool, str]] = [
        (t.streams_audited == t.sent - t.refused,
         f"every accepted stream audited: {t.streams_audited} of {t.sent - t.refused} ({t.streams_unaudited} not)"),
        (t.streams_not_in_log == 0,
         f"every stream whose client received tokens found in the token log: {t.streams_not_in_log} not"),
        (not failures, f"no failure but {sorted(want.allowed_failures) or 'none'}: {failures}"),
        (t.completed >= needed, f"at least {needed} streams completed: {t.completed}"),
        (not want.must_fail or bool(t.failed), "the scenario's designed failures happened: none did"),
        (t.hit_mid_generation >= want.min_hit,
         f"the fault hit at least {want.min_hit} streams mid-generation: {t.hit_mid_generation}"),
        (t.taken_over >= want.min_taken_over, f"at least {want.min_taken_over} requests taken over: {t.taken_over}"),
        (t.resumed_streams >= want.min_resumed,
         f"at least {want.min_resumed} streams resumed by their clients: {t.resumed_streams}"),
        (t.tokens_duplicated == 0, f"no token duplicated: {t.tokens_duplicated}"),
        (t.tokens_lost == 0, f"no token lost: {t.tokens_lost}"),
        (t.spliced_streams == 0, f"no stream spliced: {t.spliced_streams}"),
        (t.generated_for_nobody <= want.max_generated_for_nobody,
         f"at most {want.max_generated_for_nobody} tokens generated for nobody: {t.generated_for_nobody}"),
        (t.ledger_minus_replay == 0, f"the ledger equals the usage log: {t.ledger_minus_replay} discrepancies"),
        (t.usage_recorded_twice == 0, f"no request with two usage records: {t.usage_recorded_twice}"),
        (t.billed_for_nobody == 0, f"nobody billed beyond what they received: {t.billed_for_nobody}"),
        (t.billed_short == 0, f"every received token billed: {t.billed_short} not"),
        (t.turns_misrecorded == 0, f"every answered turn in its conversation once: {t.turns_misrecorded} not"),
        (t.spend_wiped or Decimal(t.spend_minus_ledger_usd) == 0,
         f"the org's spend equals its ledger: {t.spend_minus_ledger_usd} USD apart"),
    ]
    return [what for ok, what in goals if not ok]


# --- gathering ------------------------------------------------------------------------------------------------


async def audit(scenario: str, settings: Settings, kafka: KafkaSettings, org_id: str, streams: list[Stream],
                started_at: datetime, *, expectation: Expectation, fault_at: float | None = None,
                synthetic: bool, reference: list[str] | None = None, billing_wait_s: float = 90.0,
                redis: RedisSettings | None = None, redis_wiped: bool = False,
                conversations: tuple[str, str] | None = None) -> Table:
    """Gather a run's evidence and judge it. ``conversations``: the gateway's base URL and the API key, for a load
    whose streams are conversation turns."""
    evidence = await gather(scenario, settings, kafka, org_id, streams, started_at, expectation=expectation,
                            fault_at=fault_at, synthetic=synthetic, reference=reference,
                            billing_wait_s=billing_wait_s, redis=redis, redis_wiped=redis_wiped,
                            conversations=conversations)
    return judge(evidence)


async def gather(scenario: str, settings: Settings, kafka: KafkaSettings, org_id: str, streams: list[Stream],
                 started_at: datetime, *, expectation: Expectation, fault_at: float | None, synthetic: bool,
                 reference: list[str] | None, billing_wait_s: float, redis: RedisSettings | None,
                 redis_wiped: bool, conversations: tuple[str, str] | None) -> Evidence:
    evidence = Evidence(scenario, streams, expectation, started_at, fault_at, synthetic, reference=reference,
                        spend_wiped=redis_wiped)
    evidence.requests = {e.request_id: e for queue in TOPICS.work_queues() for *_, e, _ in await read_to_end(
        kafka, kafka.topic(queue.name), codec_for(ChatRequest))}
    for *_, event, _ in await read_to_end(kafka, kafka.topic(TOPICS.tokens.name), codec_for(TokenEvent),
                                          isolation="read_uncommitted"):
        for delta in event.split():
            evidence.tokens.setdefault(delta.request_id, []).append(delta)
    if not synthetic:
        evidence.client_tokens = await asyncio.to_thread(client_token_counts, settings, streams)
    if conversations is not None:
        evidence.turns = await _turns(streams, *conversations)
    await _billing(evidence, settings, kafka, org_id, billing_wait_s)
    if redis is not None:
        rows = evidence.ledger
        evidence.spend_minus_ledger_nanos = (await _billed_spend(redis, org_id, rows)
                                             - ledger_nanos(r.cost for r in rows))
    return evidence


def client_token_counts(settings: Settings, streams: Iterable[Stream]) -> dict[str, int]:
    """What each client received, in the model's tokens, from what the client itself knows, never from the usage the
    server reported: a stream the load sent with ``ignore_eos`` that ended with ``finish_reason: length`` holds exactly
    the ``max_tokens`` it asked for (the API's meaning of that reason); any other its text tokenized by the model's
    tokenizer. Tokenizing is not exact for every text (a model may emit a split the tokenizer would not: 2 of 120
    SmolLM2 answers of 40 tokens re-tokenized to 39), which is why a full stream is counted by its request."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(settings.model.path), local_files_only=True)
    return {s.request_id: s.max_tokens if s.completed and s.finish_reason == "length"
            else len(tokenizer.encode(s.text, add_special_tokens=False))
            for s in streams if s.request_id}


async def _turns(streams: list[Stream], base_url: str, api_key: str, wait_s: float = 60.0) -> Turns:
    """Every completed turn is in its conversation exactly once, as the client received it; nothing else is (a
    failed turn is not appended). The writer catches up after its restart: wait for it, within ``wait_s``."""
    import httpx

    # An answered turn is appended: finished, or cut by the output filter after some text
    expected = {s.conversation_id: ([s.prompt, s.text] if s.completed or (s.finish_reason == "content_filter"
                                                                         and s.text) else [])
                for s in streams if s.conversation_id}
    wrong: dict[str, str] = {}
    deadline = time.monotonic() + wait_s
    async with httpx.AsyncClient(base_url=base_url, headers={"Authorization": f"Bearer {api_key}"},
                                 timeout=30) as client:

        async def items(conversation_id: str) -> list[str] | None:
            answer = await client.get(f"/conversations/{conversation_id}/items", params={"order": "asc", "limit": 100})
            if answer.status_code != 200:
                return None  # unreadable right now (a 503): read again
            return ["".join(p["text"] for p in item["content"]) for item in answer.json()["data"]]

        pending = dict(expected)
        while pending:
            for conversation_id, want in list(pending.items()):
                got = await items(conversation_id)
                if got == want:
                    pending.pop(conversation_id)
                    wrong.pop(conversation_id, None)
                else:
                    wrong[conversation_id] = "unreadable" if got is None else f"{len(got)} items, {len(want)} expected"
            if not pending or time.monotonic() > deadline:
                break
            await asyncio.sleep(1.0)
        await asyncio.sleep(2.0)  # a late redelivery would add copies now: read every conversation once more
        for conversation_id, want in expected.items():
            got = await items(conversation_id)
            if got != want:
                wrong.setdefault(conversation_id, "unreadable" if got is None else f"{len(got)} items, "
                                                                                  f"{len(want)} expected")
    return Turns(len(expected), wrong)


async def _billed_spend(settings: RedisSettings, org_id: str, rows: list[LedgerRow]) -> int:
    client = make_redis(settings)
    book = SpendBook(client, settings)
    try:
        months = {month_of(r.requested_at) for r in rows}
        return sum([(await book.read(org_id, month)).billed_nanos for month in months])
    finally:
        await client.aclose()


async def _billing(evidence: Evidence, settings: Settings, kafka: KafkaSettings, org_id: str, wait_s: float
                   ) -> None:
    started_at = evidence.started_at
    start, end = started_at - timedelta(minutes=1), datetime.now(started_at.tzinfo) + timedelta(minutes=5)
    cluster, session = await connect_async(settings.cassandra)
    try:
        ledger = await Ledger.open(session, settings.cassandra.keyspace)
        lead = PriceLead(settings.processors.price_reload_s)
        prices = await (await asyncio.to_thread(PriceStore, session, settings.cassandra.keyspace, lead)).load()
        deadline = time.monotonic() + wait_s
        while True:  # the billing processor commits every second or so: give it time to catch up
            replay = await replay_usage(kafka, start, end)
            report = await reconcile(ledger, prices, replay, start, end, repair=False, org_id=org_id)
            if report.clean or time.monotonic() > deadline:
                break
            await asyncio.sleep(2)
        evidence.discrepancies = [f"{d.kind} {d.request_id}: {d.detail}" for d in report.discrepancies]
        ours = replay.only_org(org_id)
        evidence.usage_records = Counter(event.request_id for *_, event in ours.records)
        # Every request this load sent or the usage log names: a row billed for a request nobody made shows too
        ids = set(ours.first) | {s.request_id for s in evidence.streams if s.request_id}
        evidence.ledger = list((await ledger.full_rows(ids)).values())
    finally:
        await asyncio.to_thread(cluster.shutdown)
