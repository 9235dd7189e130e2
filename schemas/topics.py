"""The topic map: the only place topic names exist.

Services refer to topics through these specs (``TOPICS.tokens``), and resolve the physical name with their
Kafka settings' namespace. The stack manager creates exactly these topics (auto-creation is off on the broker),
and ``infra/terraform`` consumes the JSON export of this map (a contract test keeps it current).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal

from schemas.events import (
    AbuseAlert,
    BudgetAlert,
    ChatRequest,
    ControlEvent,
    Event,
    KeyRecord,
    OrgRecord,
    RequestsRefused,
    SafetyVerdict,
    StoredCompletion,
    TokenEvent,
    UsageEvent,
)

HOUR_MS = 3_600_000
DAY_MS = 24 * HOUR_MS


@dataclass(frozen=True)
class TopicSpec:
    name: str
    event: type[Event] | None  # None: raw bytes (the dead-letter topic keeps records as they came)
    key: str
    partitions: int
    retention_ms: int
    producers: tuple[str, ...]
    consumers: tuple[str, ...]
    description: str
    cleanup_policy: Literal["delete", "compact", "compact,delete"] = "delete"
    extra_config: dict[str, str] = field(default_factory=dict)

    def configs(self) -> dict[str, str]:
        return {
            "cleanup.policy": self.cleanup_policy,
            "retention.ms": str(self.retention_ms),
            **self.extra_config,
        }

    def export(self) -> dict[str, object]:
        data = asdict(self)
        data["event"] = self.event.__name__ if self.event else "raw"
        data["configs"] = self.configs()
        data.pop("extra_config")
        return data


@dataclass(frozen=True)
class TopicMap:
    requests_submitted: TopicSpec
    requests_refused: TopicSpec
    requests_admitted_high: TopicSpec
    requests_admitted: TopicSpec
    requests_admitted_low: TopicSpec
    tokens: TopicSpec
    control: TopicSpec
    usage: TopicSpec
    stored_completions: TopicSpec
    verdicts: TopicSpec
    alerts: TopicSpec
    budget_alerts: TopicSpec
    orgs: TopicSpec
    keys: TopicSpec
    dead_letter: TopicSpec

    def all(self) -> list[TopicSpec]:
        return [getattr(self, name) for name in self.__dataclass_fields__]

    def admitted(self, priority: str) -> TopicSpec:
        """The work queue of one priority class (``high``, ``standard``, ``low``)."""
        return {"high": self.requests_admitted_high, "low": self.requests_admitted_low}.get(priority,
                                                                                              self.requests_admitted)

    def work_queues(self) -> list[TopicSpec]:
        """Every class's work queue, highest first."""
        return [self.admitted(p) for p in PRIORITIES]


#: the priority classes, highest first
PRIORITIES = ("high", "standard", "low")


def _work_queue(name: str, about: str) -> TopicSpec:
    """One priority class's work queue: requests cleared for generation."""
    return TopicSpec(
        name=name,
        event=ChatRequest,
        key="conversation_id, else request_id",
        partitions=6,
        retention_ms=7 * DAY_MS,
        producers=("safety pre-filter", "gateway (pre-filter off)"),
        consumers=("inference workers (group inference-workers)",),
        description=f"Requests cleared for generation, {about}",
    )


TOPICS = TopicMap(
    requests_submitted=TopicSpec(
        name="llm.requests.submitted.v1",
        event=ChatRequest,
        key="conversation_id, else request_id",
        partitions=6,
        retention_ms=7 * DAY_MS,
        producers=("gateway",),
        consumers=("safety pre-filter", "abuse detector"),
        description="Every accepted chat request, before the safety pre-filter.",
    ),
    requests_refused=TopicSpec(
        name="llm.requests.refused.v1",
        event=RequestsRefused,
        key="key_id",
        partitions=6,
        retention_ms=1 * DAY_MS,
        producers=("gateway (per key, at most once a report interval while it refuses the key's requests)",),
        consumers=("abuse detector",),
        description="Requests refused at admission (429), counted per key by each gateway and reported in batches: "
                    "a client hammering through its 429s is visible to the abuse detector, at no Kafka write per "
                    "refusal.",
    ),
    requests_admitted_high=_work_queue(
        "llm.requests.admitted.high.v1", "priority class high (enterprise): drained first."),
    requests_admitted=_work_queue(
        "llm.requests.admitted.v1", "priority class standard (plus); the workers' work queue after the high class's."),
    requests_admitted_low=_work_queue(
        "llm.requests.admitted.low.v1", "priority class low (free): served after the higher classes, with a "
        "guaranteed minimum share of admissions."),
    tokens=TopicSpec(
        name="llm.tokens.emitted.v1",
        event=TokenEvent,
        key="request_id (partition = the requesting gateway's reply partition)",
        partitions=16,
        retention_ms=1 * DAY_MS,
        producers=("inference workers (deltas idempotent; finals in per-request-partition transactions)",
                   "safety pre-filter (refusals, expired and unreadable requests)"),
        consumers=("gateway SSE relays (one partition each)", "safety post-filter"),
        description="Token deltas and each request's final event; one partition per gateway instance.",
        # The broker's clock, not each worker's: a takeover finds a request's events by time (from its creation,
        # minus a margin for the gateway's clock) when their first offset is unknown.
        extra_config={"message.timestamp.type": "LogAppendTime"},
    ),
    control=TopicSpec(
        name="llm.control.issued.v1",
        event=ControlEvent,
        key="request_id",
        partitions=3,
        retention_ms=1 * DAY_MS,
        producers=("gateway (client disconnect)", "safety post-filter (halt)"),
        consumers=("every inference worker (all partitions, no group)",),
        description="Cancel and halt instructions for in-flight requests.",
    ),
    usage=TopicSpec(
        name="llm.usage.recorded.v1",
        event=UsageEvent,
        key="request_id",
        partitions=6,
        retention_ms=-1,
        producers=("inference workers (transactional)",),
        consumers=("billing aggregator", "abuse detector", "reconcile", "usage export"),
        description="One committed usage record per finished request: the billing source of truth.",
    ),
    stored_completions=TopicSpec(
        name="llm.completions.stored.v1",
        event=StoredCompletion,
        key="completion_id",
        partitions=6,
        retention_ms=7 * DAY_MS,
        producers=("inference workers (in the transaction of the request's final event)",
                   "safety processor (the requests it ends: refused, or expired before screening)"),
        consumers=("store processor, the conversation writer (Cassandra: stored_completions, conversation_items, "
                   "stored_responses)",),
        description="Finished completions to record, one record each: chat completions whose clients asked to "
                    "store them (store: true; what GET /v1/chat/completions/{id} and its list serve), and every "
                    "turn of a conversation or of the Responses API (its new input and answer: what the "
                    "conversation's items and GET /v1/responses/{id} serve).",
    ),
    verdicts=TopicSpec(
        name="llm.safety.verdicts.v1",
        event=SafetyVerdict,
        key="request_id",
        partitions=3,
        retention_ms=30 * DAY_MS,
        producers=("safety pre-filter (every request)", "safety post-filter (blocks)"),
        consumers=("abuse detector", "analysts"),
        description="Safety decisions: every pre-filter verdict, and the post-filter's halts.",
    ),
    alerts=TopicSpec(
        name="llm.abuse.alerts.v1",
        event=AbuseAlert,
        key="alert_id (deterministic: rule, key, window)",
        partitions=3,
        retention_ms=90 * DAY_MS,
        producers=("abuse detector",),
        consumers=("operators", "analysts"),
        description="Keys flagged or suspended by the abuse detector; compaction keeps one record per alert id.",
        cleanup_policy="compact,delete",
    ),
    budget_alerts=TopicSpec(
        name="llm.billing.alerts.v1",
        event=BudgetAlert,
        key="alert_id (deterministic: org, month, kind, budget)",
        partitions=3,
        retention_ms=400 * DAY_MS,
        producers=("billing aggregator (when a charge crosses an org's alert threshold or its budget)",),
        consumers=("operators", "org admins' notifications"),
        description="Monthly budget alerts: an org's billed spend crossed its alert fraction, or reached its budget "
                    "(its requests then get 429 insufficient_quota); compaction keeps one record per alert id.",
        cleanup_policy="compact,delete",
    ),
    orgs=TopicSpec(
        name="llm.tenancy.orgs.v1",
        event=OrgRecord,
        key="org_id",
        partitions=1,
        retention_ms=-1,
        producers=("admin API and `kns orgs` (through the tenancy admin)",),
        consumers=("every gateway (materialised in memory, from the beginning)",),
        description="The org registry, the record of truth: each org's latest tier, limit overrides and budget.",
        cleanup_policy="compact",
    ),
    keys=TopicSpec(
        name="llm.tenancy.keys.v1",
        event=KeyRecord,
        key="key_hash (SHA-256 of the secret)",
        partitions=1,
        retention_ms=-1,
        producers=("admin API and `kns keys` (through the tenancy admin)",),
        consumers=("every gateway (materialised in memory, from the beginning)",),
        description="The key registry, the record of truth: each secret's hash, org, expiry, models, revocation. "
                    "A revocation reaches every gateway as one record, within the fetch latency.",
        cleanup_policy="compact",
    ),
    dead_letter=TopicSpec(
        name="llm.deadletter.v1",
        event=None,
        key="the original record's key",
        partitions=3,
        retention_ms=30 * DAY_MS,
        producers=("stream processors", "inference workers", "gateway relays"),
        consumers=("operators",),
        description="Records a processor could not decode, as they came; headers: reason, source partition/offset.",
    ),
)


def export_json() -> str:
    """The topic map as JSON, the input of ``infra/terraform`` (``python -m schemas.topics``)."""
    import json

    return json.dumps({"topics": [spec.export() for spec in TOPICS.all()]}, indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    print(export_json(), end="")
