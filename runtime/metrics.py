"""Every Prometheus metric of the platform, named once.

Latency histograms use buckets from 1 ms to 60 s: token hops are milliseconds, generations are seconds.
"""

from __future__ import annotations

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, Histogram, generate_latest

_FAST = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
_SLOW = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0)

# --- shared -------------------------------------------------------------------------------------------
GC_PAUSE = Histogram(
    "kns_gc_pause_seconds", "Pauses of Python's cyclic garbage collector (the event loop stands still meanwhile)",
    ["generation"], buckets=_FAST,
)
DECODE_ERRORS = Counter("kns_decode_errors_total", "Records that no released schema decodes", ["topic"])
KAFKA_HOP = Histogram(
    "kns_kafka_hop_seconds",
    "Producer wall clock to consumer wall clock, per hop",
    ["hop"],
    buckets=_FAST,
)

DEAD_LETTERED = Counter(
    "kns_dead_lettered_total", "Records sent to the dead-letter topic, by the service that could not read them",
    ["processor", "topic"]
)

# --- gateway ------------------------------------------------------------------------------------------
GATEWAY_REQUESTS = Counter(
    "kns_gateway_requests_total", "Chat completion requests by outcome", ["outcome", "stream"]
)
GATEWAY_IN_FLIGHT = Gauge("kns_gateway_requests_in_flight", "Chat completions being answered")
GATEWAY_TOKENIZER = Counter(
    "kns_gateway_tokenizer_total", "Answered /tokenize and /detokenize calls (op: tokenize, detokenize)", ["op"]
)
GATEWAY_PROMPT = Histogram(
    "kns_gateway_prompt_seconds", "Rendering one prompt (chat template) and tokenizing it (a conversation's turn "
    "that must be truncated renders several)", buckets=_FAST
)
GATEWAY_TTFT = Histogram(
    "kns_gateway_ttft_seconds", "Request received to first token sent", buckets=_SLOW
)
GATEWAY_ITL = Histogram(
    "kns_gateway_inter_token_seconds", "Gap between token deltas sent to a client", buckets=_FAST
)
GATEWAY_E2E = Histogram("kns_gateway_e2e_seconds", "Request received to last byte sent", buckets=_SLOW)
GATEWAY_TOKENS_OUT = Counter("kns_gateway_tokens_out_total", "Completion tokens delivered to clients")
GATEWAY_CANCELS = Counter("kns_gateway_cancels_total", "Cancel events produced for departed clients")
GATEWAY_DROPPED = Counter(
    "kns_gateway_dropped_connections_total",
    "Streamed client connections that dropped and were detached (generation goes on for the resume window)")
GATEWAY_RESUMES = Counter(
    "kns_gateway_stream_resumes_total", "Streams resumed on this gateway (Last-Event-ID, starting_after), by outcome",
    ["outcome"]
)
GATEWAY_HANDOVERS = Counter(
    "kns_gateway_stream_handovers_total", "Streams this gateway closed while stopping, for their clients to resume "
    "elsewhere (the generation goes on)"
)
GATEWAY_EARLY_REFUSALS = Counter(
    "kns_gateway_early_refusals_total", "Requests refused before any work on them (producers/gateway/early.py): a "
    "refusal remembered, or too many of the key's requests being prepared at once", ["reason"])
GATEWAY_READ_WAITS = Histogram(
    "kns_gateway_read_wait_seconds", "Reads that waited for a row the writer had yet to write after its create "
    "returned (read-your-writes: written, or timed_out)", ["outcome"], buckets=_FAST
)
GATEWAY_TURN_WAITS = Counter(
    "kns_gateway_turn_waits_total", "Conversation turns that waited for their previous turn to be written "
    "(written: it was; timed_out: the turn went on without it)", ["outcome"]
)
GATEWAY_TRUNCATED_ITEMS = Counter(
    "kns_gateway_truncated_items_total", "History items left out of turns to fit the model's context"
)
STORED_RESPONSES = Counter(
    "kns_store_responses_total", "Stored responses written by the store processor (created: a new row)", ["created"]
)
CONVERSATION_ITEMS = Counter(
    "kns_store_conversation_items_total", "Conversation items appended by the conversation writer (upserts)"
)
STORED_COMPLETIONS = Counter(
    "kns_store_completions_total", "Stored completions written by the store processor (created: a new row)",
    ["created"]
)
GATEWAY_LEASE = Counter(
    "kns_gateway_reply_lease_renewals_total", "Reply-partition lease renewals, by outcome", ["state"]
)

# --- limits -------------------------------------------------------------------------------------------
LIMITER_DECISIONS = Counter(
    "kns_limiter_decisions_total", "Admissions by outcome (admitted, or the limit that refused) and limiter",
    ["outcome", "limiter"]
)
LIMITER_SECONDS = Histogram("kns_limiter_seconds", "Time one admission took", ["limiter"], buckets=_FAST)
LIMITER_REDIS_DOWN = Counter(
    "kns_limiter_redis_down_total", "Admissions with the shared limiter unreachable, by the tier's policy", ["policy"]
)
LIMITER_SETTLED = Counter("kns_limiter_settled_total", "Reservations settled by workers after their commit")

# --- relay --------------------------------------------------------------------------------------------
RELAY_EVENTS = Counter("kns_relay_events_total", "Token events read from the reply partition", ["kind"])
RELAY_STREAMS = Gauge("kns_relay_streams", "Requests registered with the relay")

# --- worker -------------------------------------------------------------------------------------------
WORKER_CONSUMED = Counter("kns_worker_requests_consumed_total", "Request records taken off the topic")
WORKER_SKIPPED = Counter(
    "kns_worker_requests_skipped_total", "Request records not generated, by reason", ["reason"]
)
WORKER_IN_FLIGHT = Gauge("kns_worker_requests_in_flight", "Requests generating in the engine")
WORKER_QUEUE_DEPTH = Gauge(
    "kns_worker_queue_depth", "Requests waiting in this worker's partitions of each priority class's work queue "
    "(end offset - position); sum over workers for the class's queue depth", ["priority"])
WORKER_FINISHED = Counter(
    "kns_worker_requests_finished_total", "Requests finished, by finish reason", ["finish_reason"]
)
WORKER_ABORTED = Counter(
    "kns_worker_requests_aborted_total", "Generations aborted in the engine, by cause", ["cause"]
)
WORKER_CLAIM = Histogram(
    "kns_worker_claim_seconds", "Claiming a consumed request (Redis), before the engine sees it", buckets=_FAST
)
WORKER_TTFT = Histogram(
    "kns_worker_ttft_seconds", "Request consumed to first engine output", buckets=_SLOW
)
WORKER_TOKENS_OUT = Counter("kns_worker_tokens_out_total", "Completion tokens emitted")
WORKER_UNATTENDED_TOKENS = Counter(
    "kns_worker_unattended_tokens_total",
    "Completion tokens generated after every client connection of the stream had gone and dropped unsent (the "
    "generation is suspended then): the work done for nobody")
WORKER_REPLAYED_TOKENS = Counter(
    "kns_worker_replayed_tokens_total", "Completion tokens generated again and dropped to continue a stream exactly "
    "(a takeover, or a resume after a suspension, of a seeded, penalized or stop-string request: its sampler cannot "
    "continue from the emitted tokens); not billed")
WORKER_SUSPENDED = Gauge(
    "kns_worker_suspended_streams", "Generations suspended because no client connection is attached (waiting for "
    "one to come back within the resume window)")
WORKER_TXN = Histogram(
    "kns_worker_finalize_txn_seconds", "Duration of one finalizing Kafka transaction", buckets=_FAST
)
WORKER_TXN_BATCH = Histogram(
    "kns_worker_finalize_batch_size", "Requests finalized per transaction", buckets=(1, 2, 4, 8, 16, 32, 64)
)
WORKER_TOKEN_RECORDS = Histogram(
    "kns_worker_token_record_events", "Token deltas per produced token record (one record per engine step per "
    "reply partition)", buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256)
)
WORKER_FINALIZE_FAILURES = Counter(
    "kns_worker_finalize_failures_total", "Finalizing transactions that failed, by kind", ["kind"]
)
WORKER_TAKEOVERS = Counter(
    "kns_worker_takeovers_total", "Requests taken over from an earlier attempt, by how", ["mode"]
)
WORKER_REBALANCES = Counter(
    "kns_worker_rebalance_partitions_total", "Request partitions per rebalance outcome", ["outcome"]
)
WORKER_DEFERRED = Counter(
    "kns_worker_admission_deferred_total", "Request records handed back to be retried later, by reason", ["reason"]
)


# --- stream processors -----------------------------------------------------------------------------------
SAFETY_VERDICTS = Counter(
    "kns_safety_verdicts_total", "Safety decisions", ["stage", "blocked", "category"]
)
SAFETY_CLASSIFY = Histogram(
    "kns_safety_classify_seconds", "Time to classify one batch of texts", ["stage"], buckets=_FAST
)
SAFETY_STALE = Counter(
    "kns_safety_stale_total", "Records too old to act on (their client is gone), skipped", ["stage"]
)
SAFETY_PREFILTER_DELAY = Histogram(
    "kns_safety_prefilter_delay_seconds", "Request submitted (gateway) to forwarded or refused (pre-filter)",
    buckets=_FAST,
)
BILLING_RECORDED = Counter(
    "kns_billing_usage_total", "Usage events billed, by whether they created the ledger row", ["created"]
)
BILLING_HOURS_RECOMPUTED = Counter("kns_billing_hours_recomputed_total", "Hourly aggregates recomputed")
BUDGET_ALERTS = Counter("kns_budget_alerts_total", "Budget alerts raised, by kind (threshold, exhausted)", ["kind"])
ABUSE_ALERTS = Counter("kns_abuse_alerts_total", "Abuse alerts raised", ["rule", "action"])

#: ``GET /metrics`` for any of our HTTP apps (a plain route: a mounted app would redirect to /metrics/)
metrics_router = APIRouter()


@metrics_router.get("/metrics", include_in_schema=False)
async def metrics() -> Response:
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

WORKER_EVICTIONS = Counter(
    "kns_worker_evictions_total", "Dead peers this worker evicted from the group (their Redis lease was gone)",
    ["outcome"]
)
