"""The one settings object of the platform.

Every process calls :func:`load_settings` once (in its entry point) and passes the sections it needs down to
constructors. Nothing else reads the environment. Environment variables use the ``KNS_`` prefix and ``__``
between nested sections, e.g. ``KNS_KAFKA__BOOTSTRAP_SERVERS`` or ``KNS_GATEWAY__PORT``.
"""

from __future__ import annotations

import socket
from functools import cached_property
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from runtime.event_loop import EventLoop

REPO_ROOT = Path(__file__).resolve().parent.parent


class KafkaSettings(BaseModel):
    bootstrap_servers: str = "127.0.0.1:19092"
    # Namespaces every topic and consumer group: lets a test session or a second environment share a broker.
    namespace: str = ""
    client_id: str = "kns"
    request_timeout_ms: int = 30_000
    # A long poll returns as soon as a record arrives, so this bounds only idle polls: a short wait buys no latency
    # and makes idle consumers re-poll the broker all the time (bench: kns bench kafka-hop).
    fetch_max_wait_ms: int = 100
    # The same for a follower (``make_consumer(follower=True)``). While a poll is parked at the broker, the
    # consumer cannot fetch anew (after a pause, resume or seek), and the broker answers nothing else on its
    # connection (end offsets, offsets for times): Kafka takes one request per connection at a time. A consumer
    # that does none of these once it follows can poll long; each idle poll costs it and the broker a round trip.
    follow_fetch_max_wait_ms: int = 500
    producer_linger_ms: int = 0
    compression: Literal["none", "lz4", "gzip", "zstd", "snappy"] = "lz4"
    session_timeout_ms: int = 10_000
    heartbeat_interval_ms: int = 1_000
    max_poll_interval_ms: int = 300_000
    transaction_timeout_ms: int = 60_000

    @model_validator(mode="after")
    def _coherent(self) -> KafkaSettings:
        if self.heartbeat_interval_ms * 3 > self.session_timeout_ms:
            raise ValueError(f"kafka.heartbeat_interval_ms ({self.heartbeat_interval_ms}) must be at most a third "
                             f"of kafka.session_timeout_ms ({self.session_timeout_ms}), or a live member is "
                             "taken for dead after one late heartbeat")
        return self

    def topic(self, name: str) -> str:
        return f"{self.namespace}.{name}" if self.namespace else name

    def group(self, name: str) -> str:
        return f"{self.namespace}.{name}" if self.namespace else name


class CassandraSettings(BaseModel):
    hosts: list[str] = ["127.0.0.1"]
    port: int = 19042
    keyspace: str = "kns"
    replication_factor: int = 1
    connect_timeout_s: float = 10.0
    request_timeout_s: float = 10.0


class RedisSettings(BaseModel):
    url: str = "redis://127.0.0.1:16379/0"
    key_prefix: str = "kns:"
    max_connections: int = 128
    pool_timeout_s: float = 5.0
    # Every command fails within this long when Redis stops answering, instead of hanging whoever waits on it.
    socket_timeout_s: float = 2.0
    connect_timeout_s: float = 1.0


class ModelSettings(BaseModel):
    """The model the platform serves. Only local folders: nothing is fetched from a hub at run time."""

    served_name: str = "SmolLM2-135M-Instruct"
    path: Path = REPO_ROOT / ".local" / "models" / "SmolLM2-135M-Instruct"
    max_model_len: int = 2048
    owned_by: str = "kns"


def _cuda_available() -> bool:
    # Engine defaults depend on the device; torch is imported lazily so that light processes stay light.
    try:
        import torch
    except ImportError:  # pragma: no cover - torch ships with vllm
        return False
    return bool(torch.cuda.is_available())


#: vLLM's message-queue readers lose wake-ups under this spin (DEVELOPERS.md, "vLLM CPU build")
MIN_IDLE_SPIN_S = 0.003
#: the engine core's longest nap between two looks at its queue: each step's second message waits up to this long
MAX_ENGINE_CORE_NAP_S = 0.001


class EngineSettings(BaseModel):
    """vLLM engine arguments. ``None`` means: pick the default for the device (CPU here, CUDA when present)."""

    #: "synthetic" replaces the model with tokens at a fixed rate (benchmarks of everything around the engine)
    kind: Literal["vllm", "synthetic"] = "vllm"
    synthetic_tokens_per_s: float = 20.0
    synthetic_max_seqs: int = 20_000
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: str | None = None
    max_num_seqs: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.85
    #: "priority": inside the batch, a higher priority class's requests are scheduled first (and may preempt)
    scheduling_policy: Literal["fcfs", "priority"] = "priority"
    enable_prefix_caching: bool = True
    enforce_eager: bool | None = None
    max_num_batched_tokens: int | None = None
    speculative_config: dict[str, object] | None = None
    load_format: str = "auto"
    seed: int = 0
    omp_num_threads: int | None = None
    #: seconds vLLM's engine processes spin after each message before they sleep (``inference_workers/vllm_plugin``;
    #: None: vLLM's own 1 s). CPU default 5 ms: a spinning engine core takes the core Kafka and the gateway need.
    #: At least 3 ms: vLLM sends two messages per step about a millisecond apart, libzmq drops the second's
    #: wake-up (sent within 3M TSC ticks of the first, 1.2 ms here), and a reader that stopped spinning then sleeps
    #: until vLLM's 5 s recheck (measured: 1 ms stalled a request for 5 s now and then, 0 every step).
    idle_spin_s: float | None = Field(default=None, ge=MIN_IDLE_SPIN_S)
    #: seconds the engine core naps between two looks at its queue while it spins, instead of ``sched_yield``
    #: (None: vLLM's). CPU default 0.2 ms: its spin holds the core the worker, Kafka and the gateway relay on.
    engine_core_nap_s: float | None = Field(default=None, gt=0, le=MAX_ENGINE_CORE_NAP_S)
    # vLLM's compile cache; inside the ignored .local folder.
    cache_dir: Path = REPO_ROOT / ".local" / "cache" / "vllm"

    @cached_property
    def resolved_device(self) -> Literal["cpu", "cuda"]:
        if self.device != "auto":
            return self.device
        return "cuda" if _cuda_available() else "cpu"

    def effective(self) -> EngineSettings:
        """A copy with every device-dependent default filled in."""
        on_gpu = self.resolved_device == "cuda"
        return self.model_copy(
            update={
                "device": self.resolved_device,
                # bf16 answers garbage on the CPU build with this model; fp32 is exact.
                "dtype": self.dtype or ("bfloat16" if on_gpu else "float32"),
                "max_num_seqs": self.max_num_seqs or (256 if on_gpu else 16),
                # On the CPU the KV cache must be sized or vLLM takes 92 % of RAM.
                "kv_cache_memory_bytes": self.kv_cache_memory_bytes
                or (None if on_gpu else 512 * 1024 * 1024),
                # CPU: compiling the graph costs ~70 s per start for a ~35 % faster decode; eager by default so
                # the stack and the tests start quickly. Benchmarks set the same value on both sides.
                "enforce_eager": self.enforce_eager if self.enforce_eager is not None else not on_gpu,
                # Long enough to stay awake between two steps of a running batch, short enough to sleep between
                # requests; a GPU host has cores to spare for vLLM's lowest-latency default.
                "idle_spin_s": self.idle_spin_s if self.idle_spin_s is not None else (None if on_gpu else 0.005),
                "engine_core_nap_s": self.engine_core_nap_s if self.engine_core_nap_s is not None
                else (None if on_gpu else 0.0002),
            }
        )


class GatewaySettings(BaseModel):
    host: str = "127.0.0.1"
    port: int = 8000
    # Identifies this gateway process across restarts: its reply-partition claim is keyed by it.
    instance_id: str = ""
    max_body_bytes: int = 1 * 1024 * 1024
    # ``kns gateway --processes N`` (``producers/gateway/fleet.py``): N processes listen on ``port`` together
    # (SO_REUSEPORT: the kernel spreads connections over them), each with its own reply partition.
    reuse_port: bool = False
    # Each process also answers on an internal port of its own (``own_port``; 0: ``port`` + 50), on
    # ``internal_host``: the only port that serves ``/metrics`` and the detailed ``/health`` (the public port's
    # /health says only whether it serves). Keep it off the public network, as the worker's admin port.
    own_port: int = 0
    internal_host: str = "127.0.0.1"
    reply_lease_ttl_s: float = 15.0
    #: each renewal also refreshes this process's liveness key, which lives ``liveness_ttl_s``: a dead gateway's
    #: streams are cancelled (and their billing stopped) that soon after it dies
    reply_lease_renew_s: float = 1.0
    liveness_ttl_s: float = 4.0
    # A request must start generating within this long or a worker refuses it (queue_deadline_exceeded, not
    # billed): the request carries the deadline, so every worker applies the same one. A tier may set its own
    # (tenancy.tiers.<tier>.queue_deadline_s).
    queue_deadline_s: float = 60.0
    # After the deadline the gateway still waits this long for a first token (the prefill of a request started
    # just in time) before it gives up on its own and cancels.
    first_token_grace_s: float = 30.0
    # After the first token: a stream with no token event for this long ends with an error (a stalled worker).
    stream_idle_timeout_s: float = 120.0
    # A stream can be resumed on any gateway (Last-Event-ID, starting_after) for this long after it was accepted;
    # later, or for an unknown or another org's id, the answer is 404. Its tokens stay on the token topic (a day).
    resume_ttl_s: float = 900.0
    # A streamed client whose connection drops (a mobile network, a Wi-Fi handover, a tab reloaded) has this long to
    # reconnect on any gateway (Last-Event-ID, starting_after) before its generation is cancelled: the worker goes
    # on, holding what it generates until a client is back (inference_workers/listeners.py). The same as the
    # workers' grace for a gateway that died: a client cannot tell the two apart. 0: a dropped connection cancels at
    # once, as vLLM's server does. A tier may set its own (tenancy.tiers.<tier>.resume_window_s).
    resume_window_s: float = Field(default=30.0, ge=0)
    # Chat-completion stream events carry their ``id:`` line (the Last-Event-ID a client resumes with). Off: OpenAI's
    # exact bytes, for SSE parsers that read each event as one ``data:`` line (vLLM's benchmark client); a request
    # chooses for itself with the ``kns-event-ids: on|off`` header.
    sse_event_ids: bool = True
    # A conversation's next turn waits this long at most for its previous turn to be written (its items are the
    # next turn's history); past it, the turn goes on with the history written so far.
    turn_wait_s: float = 10.0
    # Read-your-writes (producers/gateway/pending_writes.py): a read of a stored completion, a stored response or
    # a conversation's items, right after its create returned, waits at most this long for the writer to write it.
    read_wait_s: float = Field(default=5.0, ge=0)
    # An item of a conversation created with its items (POST /v1/conversations) holds at most this many characters:
    # four times what the served model's context (2,048 tokens) takes, so no item that could be part of a prompt is
    # refused; 20 such items (the most a create takes, as OpenAI's) fit the body limit. Raise it with the context.
    conversation_item_max_chars: int = Field(default=32_768, gt=0)
    # A turn without max_output_tokens keeps this many tokens of the context free for its answer when its history
    # is fitted (truncation: auto).
    output_reserve_tokens: int = 512
    # Turns of one conversation are keyed by it on the work queue: one partition, hence one worker and its prefix
    # cache. Off: keyed by request id (what ``kns bench affinity`` compares against).
    conversation_affinity: bool = True

    @property
    def internal_port(self) -> int:
        return self.own_port or self.port + 50

    @model_validator(mode="after")
    def _default_instance(self) -> GatewaySettings:
        if not self.instance_id:
            self.instance_id = f"{socket.gethostname()}:{self.port}"
        for ttl in ("reply_lease_ttl_s", "liveness_ttl_s"):
            if self.reply_lease_renew_s * 2 > getattr(self, ttl):
                raise ValueError(f"gateway.reply_lease_renew_s ({self.reply_lease_renew_s}) must be at most half "
                                 f"of gateway.{ttl} ({getattr(self, ttl)}): one late renewal would lose it")
        return self


class WorkerSettings(BaseModel):
    instance_id: str = ""
    admin_host: str = "127.0.0.1"
    admin_port: int = 8100
    group: str = "inference-workers"
    # Cancels older than this at start-up are ignored: the requests they name are long gone.
    control_lookback_s: float = 600.0
    # Off: a static member does not leave the group when it stops, so a graceful stop (a rolling deploy) would
    # hold its partitions for the whole session timeout. Sticky assignment keeps partitions in place instead.
    static_membership: bool = False
    request_claim_ttl_s: int = 86_400
    finalize_batch_max: int = 64
    # A finalizing transaction that keeps failing for this long (the broker unreachable) stops the worker: its
    # supervisor restarts it and its partitions move, rather than it holding them with /health green.
    finalize_give_up_s: float = 60.0
    # A record that cannot be admitted now (request claims in Redis unreachable) is retried after this long.
    admission_retry_s: float = 1.0
    # On SIGTERM running requests get this long to finish; the rest are taken over by the partitions' next owner.
    drain_timeout_s: float = 20.0
    # A generation whose gateway is gone (no liveness key) and that no other gateway resumed (the stream's
    # listener) goes on for this long, for its client to reconnect elsewhere; then it is cancelled, billed for
    # what it generated (its tokens stay resumable).
    presence_check_s: float = 1.0
    unattended_grace_s: float = 30.0
    # Fast failover (inference_workers/liveness.py): each worker holds a Redis lease this long, renewed every
    # liveness_renew_s; its peers evict it from the group as soon as it lapses (0 turns it off: the Kafka session
    # timeout alone then finds dead workers).
    liveness_ttl_s: float = 1.0
    liveness_renew_s: float = 0.2
    # Priority classes: while a higher class has requests waiting, a lower one's partitions are paused, except that
    # each class with requests waiting still gets this share of the admissions (its starvation guard). Off: every
    # class's partitions are fetched alike (in arrival order per partition; bench priority's baseline).
    priority_classes: bool = True
    priority_min_share: float = Field(default=0.1, ge=0, le=0.5)
    # How often the waiting requests per class are looked up (end offsets) while partitions are paused.
    priority_refresh_s: float = Field(default=0.02, gt=0)
    # Token records (inference_workers/token_sink.py): version 3 carries one engine step's deltas to a reply
    # partition in one record, at most token_record_max_events of them; 2 writes one per request, for readers not
    # upgraded yet (schemas/token_batch.py: readers first, then writers).
    token_record_version: int = Field(default=3, ge=2, le=3)
    token_record_max_events: int = Field(default=256, ge=1)

    @model_validator(mode="after")
    def _default_instance(self) -> WorkerSettings:
        if not self.instance_id:
            self.instance_id = f"worker-{socket.gethostname()}-{self.admin_port}"
        if self.liveness_ttl_s and (self.liveness_ttl_s < 0.05 or self.liveness_renew_s <= 0):
            raise ValueError(f"worker.liveness_ttl_s ({self.liveness_ttl_s}) must be 0 (off) or at least 0.05, and "
                             f"worker.liveness_renew_s ({self.liveness_renew_s}) positive")
        if self.liveness_ttl_s and self.liveness_renew_s * 3 > self.liveness_ttl_s:
            raise ValueError(f"worker.liveness_renew_s ({self.liveness_renew_s}) must be at most a third of "
                             f"worker.liveness_ttl_s ({self.liveness_ttl_s}): two late renewals would evict a live "
                             "worker")
        return self


class SupervisorSettings(BaseModel):
    """How ``kns worker``, ``kns gateway`` and ``kns processor`` restart their service (``runtime/supervisor.py``)."""

    first_delay_s: float = 1.0
    max_delay_s: float = 30.0
    #: a service that ran at least this long was healthy: the next restart waits ``first_delay_s`` again
    stable_after_s: float = 60.0
    #: after a stop signal the service gets this long (a worker drains its requests) before SIGKILL
    stop_timeout_s: float = 30.0


class FaultSettings(BaseModel):
    """Fault injection for chaos runs and fault tests; off unless ``dir`` is set. A fault fires when a file
    named after its point exists in ``dir`` (its content says what to do: ``kill``, ``sleep <s>``, ``error``);
    the file is removed when it fires, so each arming fires once."""

    dir: Path | None = None


class ProcessorSettings(BaseModel):
    """The Faust stream processors (one process each: safety, billing, abuse, store)."""

    host: str = "127.0.0.1"
    safety_port: int = 8201
    billing_port: int = 8202
    abuse_port: int = 8203
    store_port: int = 8204
    # How long a dead member keeps its partitions; with static membership a restarted one takes them back at once.
    session_timeout_s: float = 10.0
    heartbeat_interval_s: float = 1.0
    commit_interval_s: float = 1.0
    billing_flush_interval_s: float = 2.0
    price_reload_s: float = 60.0

    def port(self, name: str) -> int:
        return int(getattr(self, f"{name}_port"))


class SafetySettings(BaseModel):
    classifier: str = "combined"
    #: the gateway sends requests through the safety pre-filter (the submitted topic) when true
    prefilter: bool = True
    #: the post-filter classifies a request's output every this many tokens ...
    post_stride_tokens: int = 8
    #: ... looking at this much of its latest text
    post_window_chars: int = 320
    # Chosen by leave-one-out on the exemplar set (max F1 with precision >= 0.85), never on the eval set.
    #: a request older than this when the pre-filter sees it has no client waiting any more (the gateway's idle
    #: timeout): it is dropped, not generated for nobody; token events older than post_max_age_s are not checked
    max_request_age_s: float = 120.0
    prefilter_batch: int = 16
    post_max_age_s: float = 60.0
    embedding_threshold: float = 0.35
    embedding_margin: float = 0.08
    embedding_neighbours: int = 1
    #: the bar for the text around a request (system prompts, earlier turns, windows of a long message): the lowest
    #: threshold at which no sentence of the project's own docs (1,442, benign technical prose) is blocked; a prompt
    #: has tens of windows, and each is another chance of a false alarm at the bar above
    embedding_context_threshold: float = 0.5
    embedding_context_margin: float = 0.08
    #: threads the embeddings run on: 1 beside an engine on the CPU; where cores are spare (a GPU host), more make
    #: whole-prompt screening faster (its cost grows with a prompt's new text: about 0.4 ms a token on one core)
    embedding_threads: int = Field(default=1, ge=1)


class AbuseSettings(BaseModel):
    burst_window_s: float = 10.0
    #: a key is flagged when its requests in a window, admitted and refused (429) together, reach this multiple of
    #: what its org's limits admit in that window (the limiter's full bucket plus the window's refill: a key within
    #: its limits never gets there), suspended at ``suspend_factor`` times that. Above 2, so that a client that
    #: retries no sooner than Retry-After says (at most one refusal per admission) is never flagged.
    burst_factor: float = Field(default=3.0, gt=2)
    suspend_factor: float = Field(default=2.0, ge=1)
    violations_window_s: float = 600.0
    violations_flag: int = 3
    violations_suspend: int = 6
    velocity_window_s: float = 60.0
    #: completion tokens, against what the org's tokens-per-minute limit admits in the window, likewise
    velocity_factor: float = 3.0
    addresses_window_s: float = 300.0
    addresses_flag: int = 5
    addresses_suspend: int = 20
    #: each gateway reports the requests it refused (per key) this often (``producers/gateway/refusals.py``)
    refusal_report_s: float = Field(default=1.0, gt=0)


class TierPolicy(BaseModel):
    #: the tier's rates, per key and per org unless the org overrides them (the abuse detector flags a key at a
    #: multiple of them)
    requests_per_minute: int = Field(gt=0)
    tokens_per_minute: int = Field(gt=0)
    #: requests answered at once, per key and per org
    max_concurrent: int = Field(gt=0)
    #: admission while Redis (the shared limiter) is unreachable: "closed" refuses with 503, "local" admits
    #: against a limiter of this process's own (``tenancy.local_share`` of the limits)
    when_redis_down: Literal["closed", "local"] = "closed"
    #: a request of the tier must start generating within this long (None: ``gateway.queue_deadline_s``)
    queue_deadline_s: float | None = Field(default=None, gt=0)
    #: the priority class its requests queue in (one admitted-request topic per class, ``schemas/topics.py``)
    priority: Literal["high", "standard", "low"] = "standard"
    #: how long a dropped stream waits for its client to reconnect (None: ``gateway.resume_window_s``)
    resume_window_s: float | None = Field(default=None, ge=0)
    #: what an org's conversations may keep (bytes of text and metadata, plus a fixed share per conversation and
    #: item; deleted ones until they are purged): past it, creating a conversation or growing its metadata is
    #: refused (429 insufficient_quota)
    conversation_storage_bytes: int = Field(default=50_000_000, gt=0)


_TIER_DEFAULTS: dict[str, dict[str, object]] = {
    "free": {"requests_per_minute": 30, "tokens_per_minute": 20_000, "max_concurrent": 4, "queue_deadline_s": 30.0,
             "when_redis_down": "closed", "priority": "low"},
    "plus": {"requests_per_minute": 600, "tokens_per_minute": 500_000, "max_concurrent": 64,
             "when_redis_down": "local", "priority": "standard", "conversation_storage_bytes": 5_000_000_000},
    "enterprise": {"requests_per_minute": 6_000, "tokens_per_minute": 5_000_000, "max_concurrent": 1_000,
                   "when_redis_down": "local", "priority": "high", "conversation_storage_bytes": 50_000_000_000},
}


class TierTable(BaseModel):
    """The service tiers an org can be on, lowest first (fields, so that ``KNS_TENANCY__TIERS__FREE__...`` changes
    one tier's policy without dropping the others)."""

    free: TierPolicy
    plus: TierPolicy
    enterprise: TierPolicy

    @model_validator(mode="before")
    @classmethod
    def _over_defaults(cls, given: object) -> object:
        # KNS_TENANCY__TIERS__FREE__QUEUE_DEADLINE_S arrives as {"free": {"queue_deadline_s": ...}}: the rest of
        # that tier's policy (and the other tiers) keep their defaults.
        if not isinstance(given, dict):
            return given
        merged: dict[str, object] = {}
        for name, defaults in _TIER_DEFAULTS.items():
            own = given.get(name) or {}
            merged[name] = {**defaults, **(own.model_dump(exclude_unset=True) if isinstance(own, BaseModel) else own)}
        return {**given, **merged}

    def policies(self) -> dict[str, TierPolicy]:
        return {name: getattr(self, name) for name in type(self).model_fields}

    def policy(self, tier: str) -> TierPolicy:
        """A tier's policy; an unknown tier (an old record's) gets the lowest."""
        return self.policies().get(tier, self.free)


class TenancySettings(BaseModel):
    tiers: TierTable = Field(default_factory=lambda: TierTable.model_validate({}))
    #: how long a lookup of an unknown key, or an admin change, waits for the registry view to catch up
    catch_up_timeout_s: float = 2.0
    #: an in-flight slot ends by itself this long after admission (a gateway that died frees its clients' slots)
    lease_s: float = Field(default=900.0, gt=0)
    #: a reservation no worker settled (a request lost with Redis) keeps its tokens counted this long at most
    reservation_ttl_s: int = Field(default=3600, gt=0)
    #: with Redis down, the part of each limit one gateway process admits on its own (1/N for N gateways keeps
    #: the sum at the limit)
    local_share: float = Field(default=1.0, gt=0, le=1)


class StackSettings(BaseModel):
    """Where the local stack keeps its state. Client-facing ports come from the client sections (the stack
    listens where the clients connect); only the ports no client uses are set here."""

    root: Path = REPO_ROOT / ".local"
    shared_m2: Path | None = Field(default=None, validate_default=True)
    kafka_controller_port: int = 19093
    kafka_heap: str = "768m"
    cassandra_storage_port: int = 17000
    cassandra_heap: str = "768m"
    kafka_jmx_exporter_port: int = 19404
    cassandra_jmx_exporter_port: int = 19405
    min_free_disk_gb: float = 4.0
    start_timeout_s: float = 180.0

    @field_validator("shared_m2", mode="before")
    @classmethod
    def _default_m2(cls, value: object) -> object:
        if value:
            return value
        candidate = REPO_ROOT.parent / "shared" / "m2"
        return candidate if candidate.is_dir() else None

    @property
    def data_dir(self) -> Path:
        return self.root / "data"

    @property
    def logs_dir(self) -> Path:
        return self.root / "logs"

    @property
    def run_dir(self) -> Path:
        return self.root / "run"

    @property
    def lib_dir(self) -> Path:
        return self.root / "lib"

    @property
    def dev_key_file(self) -> Path:
        return self.root / "dev-api-key"

    @property
    def dev_admin_key_file(self) -> Path:
        return self.root / "dev-admin-key"


class CpuSettings(BaseModel):
    """How the platform's processes share a host's cores with an inference engine (``runtime/cpu_priority.py``)."""

    #: the nice level of our processes beside the engine (the gateway, the processors, a worker's own threads
    #: once its engine runs, the local stack's Cassandra and Redis); the engine's processes stay at 0, so
    #: a step of the engine never waits for a core behind the relaying of the last one. 0: everything at 0.
    yield_nice: int = Field(default=10, ge=0, le=19)
    #: the local stack's Kafka broker's: every request and every token crosses it twice, and its work is short, so
    #: it waits for no one (at ``yield_nice`` each hop took 0.4-0.9 ms longer at c=1, waiting for a core behind the
    #: worker's and the gateway's Python; DEVELOPERS.md "Benchmarks on 2 cores")
    kafka_nice: int = Field(default=0, ge=0, le=19)
    #: the event loop of the worker (``runtime/event_loop.py``; the gateway's is uvicorn's, uvloop when installed)
    event_loop: EventLoop = "uvloop"


class ObservabilitySettings(BaseModel):
    log_level: str = "INFO"
    json_logs: bool = True


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="KNS_", env_nested_delimiter="__", extra="ignore", frozen=False
    )

    kafka: KafkaSettings = Field(default_factory=KafkaSettings)
    cassandra: CassandraSettings = Field(default_factory=CassandraSettings)
    redis: RedisSettings = Field(default_factory=RedisSettings)
    model: ModelSettings = Field(default_factory=ModelSettings)
    engine: EngineSettings = Field(default_factory=EngineSettings)
    gateway: GatewaySettings = Field(default_factory=GatewaySettings)
    worker: WorkerSettings = Field(default_factory=WorkerSettings)
    stack: StackSettings = Field(default_factory=StackSettings)
    observability: ObservabilitySettings = Field(default_factory=ObservabilitySettings)
    cpu: CpuSettings = Field(default_factory=CpuSettings)
    processors: ProcessorSettings = Field(default_factory=ProcessorSettings)
    safety: SafetySettings = Field(default_factory=SafetySettings)
    abuse: AbuseSettings = Field(default_factory=AbuseSettings)
    tenancy: TenancySettings = Field(default_factory=TenancySettings)
    faults: FaultSettings = Field(default_factory=FaultSettings)
    supervisor: SupervisorSettings = Field(default_factory=SupervisorSettings)

    @model_validator(mode="after")
    def _coherent(self) -> Settings:
        # Settings that cannot work together fail at start-up, with what to change.
        windows = {"gateway.resume_window_s": self.gateway.resume_window_s, **{
            f"tenancy.tiers.{name}.resume_window_s": policy.resume_window_s
            for name, policy in self.tenancy.tiers.policies().items() if policy.resume_window_s is not None}}
        for name, window in windows.items():
            if window >= self.gateway.resume_ttl_s:
                raise ValueError(f"{name} ({window}) must be shorter than gateway.resume_ttl_s "
                                 f"({self.gateway.resume_ttl_s}): a client must be able to resume within its window")
        if self.worker.unattended_grace_s <= self.gateway.reply_lease_renew_s * 2:
            raise ValueError(f"worker.unattended_grace_s ({self.worker.unattended_grace_s}) must exceed two gateway "
                             f"lease renewals ({self.gateway.reply_lease_renew_s} s each): a Redis restart drops "
                             "every gateway's liveness key until its next renewal")
        if self.gateway.stream_idle_timeout_s * 1000 <= 2 * self.kafka.session_timeout_ms:
            raise ValueError(f"gateway.stream_idle_timeout_s ({self.gateway.stream_idle_timeout_s}) must exceed "
                             f"two Kafka session timeouts ({self.kafka.session_timeout_ms} ms each): a dead "
                             "worker's streams pause that long before another worker takes them over")
        longest_wait = max(p.queue_deadline_s or self.gateway.queue_deadline_s
                           for p in self.tenancy.tiers.policies().values()) + self.gateway.first_token_grace_s
        if self.tenancy.lease_s <= longest_wait:
            raise ValueError(f"tenancy.lease_s ({self.tenancy.lease_s}) must exceed the longest a request may wait "
                             f"for its first token ({longest_wait:.0f} s: queue deadline + grace): an in-flight slot "
                             "would end while its request still runs")
        return self


def load_settings(**overrides: object) -> Settings:
    """Build the settings from the environment (``KNS_*``) plus explicit overrides. Call once per process."""
    return Settings(**overrides)  # type: ignore[arg-type]
