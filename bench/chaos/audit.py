"""What a chaos run did to its streams and its bill, from the client's view, the event log and the ledger.

Per request, the text the client received is compared token by token with what an uninterrupted generation of
the synthetic model gives for the same prompt (read back from the request topic): tokens received twice
(duplicated), tokens missing from a stream that claims to be complete (lost), and streams that are not one
generation's text at all (spliced). The token topic says how often a token position was produced (more than
once: generated again) and which requests were taken over. Billing: the ledger is reconciled against a replay
of the usage topic (ledger minus replay), and every billed row is checked against what its client received
(billed for nobody: more completion tokens billed than delivered, or a prompt billed to a client that got
nothing). With the real model (``--engine vllm``) the same prompts are first run without a fault, and each stream's
text is compared with that reference instead (duplicated and lost tokens are then not counted separately).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections import Counter
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
#: a stream silent for longer than this was hit by the fault (synthetic tokens come every 50 ms)
AFFECTED_S = 1.0


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
    tokens_duplicated: int = 0
    tokens_lost: int = 0
    spliced_streams: int = 0
    #: token positions some worker produced more than once (zombies, regenerations from scratch)
    tokens_generated_twice: int = 0
    #: requests continued by another attempt (the failover path)
    taken_over: int = 0
    affected_streams: int = 0
    recover_s: dict[str, float | None] = field(default_factory=dict)
    #: streams whose client reconnected to another gateway and got the rest (Last-Event-ID), and the time from the
    #: last chunk before the break to the first one after it
    resumed_streams: int = 0
    resume_gap_s: dict[str, float | None] = field(default_factory=dict)
    ledger_minus_replay: int = 0
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
    notes: list[str] = field(default_factory=list)

    @property
    def goals_met(self) -> bool:
        return (self.completed + sum(self.failed.values()) == self.sent and "no [DONE]" not in self.failed
                and not any(k.startswith("connection") for k in self.failed) and self.tokens_duplicated == 0
                and self.tokens_lost == 0 and self.spliced_streams == 0 and self.ledger_minus_replay == 0
                and self.billed_for_nobody == 0 and self.billed_short == 0 and self.turns_misrecorded == 0
                and (self.spend_wiped or Decimal(self.spend_minus_ledger_usd) == 0))

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "goals_met": self.goals_met}


async def audit(scenario: str, settings: Settings, kafka: KafkaSettings, org_id: str, streams: list[Stream],
                started_at: datetime, *, synthetic: bool, reference: list[str] | None = None,
                billing_wait_s: float = 90.0, redis: RedisSettings | None = None, redis_wiped: bool = False,
                conversations: tuple[str, str] | None = None) -> Table:
    """``conversations``: the gateway's base URL and the API key, for a load whose streams are conversation turns."""
    table = Table(scenario, sent=len(streams))
    outcomes = Counter(s.outcome for s in streams)
    table.completed = outcomes.pop("completed", 0)
    table.failed = dict(outcomes)
    requests = {e.request_id: e for queue in TOPICS.work_queues() for *_, e, _ in await read_to_end(
        kafka, kafka.topic(queue.name), codec_for(ChatRequest))}
    by_request: dict[str, list[TokenEvent]] = {}
    for *_, event, _ in await read_to_end(kafka, kafka.topic(TOPICS.tokens.name), codec_for(TokenEvent),
                                          isolation="read_uncommitted"):
        for delta in event.split():
            by_request.setdefault(delta.request_id, []).append(delta)
    delivered: dict[str, tuple[int, Stream]] = {}
    for stream in streams:
        ids = [int(t) for t in TOKEN.findall(stream.text)] if synthetic else []
        if stream.request_id:
            got = len(ids) if synthetic else (stream.usage or {}).get("completion_tokens", 0)
            delivered[stream.request_id] = (got, stream)
        request = requests.get(stream.request_id or "")
        if reference is not None and stream.index < len(reference):
            # A real model: text only. A complete stream must equal the uninterrupted one, a failed one its prefix.
            want = reference[stream.index]
            table.spliced_streams += int(stream.text != want if stream.completed else not want.startswith(stream.text))
        if not synthetic or request is None:
            continue
        expected, _ = expected_completion(request.prompt_token_ids, request.sampling)
        check = check_tokens(ids, expected, complete=stream.completed)
        table.tokens_duplicated += check.duplicated
        table.tokens_lost += check.lost
        table.spliced_streams += int(check.spliced)
    for events in by_request.values():
        covered = Counter(e.token_offset + k for e in events for k in range(len(e.token_ids)))
        table.tokens_generated_twice += sum(n - 1 for n in covered.values() if n > 1)
        table.taken_over += int(len({e.attempt for e in events}) > 1)
    silences = [s.longest_silence() for s in streams if s.longest_silence() > AFFECTED_S]
    table.affected_streams = len(silences)
    table.recover_s = {k: v for k, v in percentiles(silences).items() if k in ("p50", "p99")}
    table.resumed_streams = sum(1 for s in streams if s.resumes)
    gaps = [g for s in streams for g in s.resume_gaps]
    table.resume_gap_s = {k: v for k, v in percentiles(gaps).items() if k in ("p50", "p99")}
    if conversations is not None:
        await _turns(table, streams, *conversations)
    rows = await _billing(table, settings, kafka, org_id, delivered, started_at, billing_wait_s)
    if redis is not None:
        table.spend_wiped = redis_wiped
        table.spend_minus_ledger_usd = str(usd(await _billed_spend(redis, org_id, rows)
                                               - ledger_nanos(r.cost for r in rows)))
    return table


async def _turns(table: Table, streams: list[Stream], base_url: str, api_key: str, wait_s: float = 60.0) -> None:
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
    table.turns_checked = len(expected)
    table.turns_misrecorded = len(wrong)
    table.notes += [f"conversation {c}: {why}" for c, why in list(wrong.items())[:5]]


async def _billed_spend(settings: RedisSettings, org_id: str, rows: list[LedgerRow]) -> int:
    client = make_redis(settings)
    book = SpendBook(client, settings)
    try:
        months = {month_of(r.requested_at) for r in rows}
        return sum([(await book.read(org_id, month)).billed_nanos for month in months])
    finally:
        await client.aclose()


async def _billing(table: Table, settings: Settings, kafka: KafkaSettings, org_id: str,
                   delivered: dict[str, tuple[int, Stream]], started_at: datetime, wait_s: float
                   ) -> list[LedgerRow]:
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
        table.ledger_minus_replay = len(report.discrepancies)
        table.notes += [f"{d.kind} {d.request_id}: {d.detail}" for d in report.discrepancies[:5]]
        rows = await ledger.full_rows(replay.only_org(org_id).first.keys())
        for request_id, row in rows.items():
            if utc(row.requested_at) < started_at:
                continue  # a reference pass before the fault (``--engine vllm``): delivered, not audited here
            got, stream = delivered.get(request_id, (0, None))
            nothing = got == 0 and (stream is None or not stream.completed)
            if row.completion_tokens > got or (row.prompt_tokens > 0 and nothing):
                table.billed_for_nobody += 1
                table.notes.append(f"billed beyond delivery {request_id}: billed {row.prompt_tokens} + "
                                   f"{row.completion_tokens}, received {got}")
            elif row.completion_tokens < got:
                table.billed_short += got - row.completion_tokens
                table.notes.append(f"billed short {request_id}: billed {row.completion_tokens}, received {got}")
        for request_id, (got, _stream) in delivered.items():
            if got and request_id not in rows:
                table.billed_short += got
                table.notes.append(f"not billed {request_id}: received {got} tokens")
        return list(rows.values())
    finally:
        await asyncio.to_thread(cluster.shutdown)
