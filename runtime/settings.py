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
    producer_linger_ms: int = 0
    compression: Literal["none", "lz4", "gzip", "zstd", "snappy"] = "lz4"
    session_timeout_ms: int = 10_000
    heartbeat_interval_ms: int = 1_000
    max_poll_interval_ms: int = 300_000
    transaction_timeout_ms: int = 60_000

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
    enable_prefix_caching: bool = True
    enforce_eager: bool | None = None
    max_num_batched_tokens: int | None = None
    speculative_config: dict[str, object] | None = None
    load_format: str = "auto"
    seed: int = 0
    omp_num_threads: int | None = None
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
            }
        )


class GatewaySettings(BaseModel):
    host: str = "127.0.0.1"
    port: int = 8000
    # Identifies this gateway process across restarts: its reply-partition claim is keyed by it.
    instance_id: str = ""
    max_body_bytes: int = 1 * 1024 * 1024
    reply_lease_ttl_s: float = 15.0
    reply_lease_renew_s: float = 3.0
    api_key_cache_ttl_s: float = 30.0
    # A stream with no token event for this long ends with an error (a stalled or lost worker).
    stream_idle_timeout_s: float = 120.0
    log_unknown_fields: bool = True

    @model_validator(mode="after")
    def _default_instance(self) -> GatewaySettings:
        if not self.instance_id:
            self.instance_id = f"{socket.gethostname()}:{self.port}"
        return self


class WorkerSettings(BaseModel):
    instance_id: str = ""
    admin_host: str = "127.0.0.1"
    admin_port: int = 8100
    group: str = "inference-workers"
    # Cancels older than this at start-up are ignored: the requests they name are long gone.
    control_lookback_s: float = 600.0
    # Static membership: a restarted worker gets its partitions back without a rebalance wait.
    static_membership: bool = True
    request_claim_ttl_s: int = 86_400
    finalize_batch_max: int = 64
    # On SIGTERM running requests get this long to finish; the rest are aborted and redelivered.
    drain_timeout_s: float = 20.0

    @model_validator(mode="after")
    def _default_instance(self) -> WorkerSettings:
        if not self.instance_id:
            self.instance_id = f"worker-{socket.gethostname()}-{self.admin_port}"
        return self


class ProcessorSettings(BaseModel):
    """The Faust stream processors (one process each: safety, billing, abuse)."""

    host: str = "127.0.0.1"
    safety_port: int = 8201
    billing_port: int = 8202
    abuse_port: int = 8203
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


class TierLimit(BaseModel):
    requests_per_minute: int
    tokens_per_minute: int


class AbuseSettings(BaseModel):
    tiers: dict[str, TierLimit] = {
        "free": TierLimit(requests_per_minute=30, tokens_per_minute=20_000),
        "pro": TierLimit(requests_per_minute=600, tokens_per_minute=500_000),
        "enterprise": TierLimit(requests_per_minute=6_000, tokens_per_minute=5_000_000),
    }
    burst_window_s: float = 10.0
    #: a key is flagged at this multiple of its tier's rate (per window), suspended at ``suspend_factor`` of it
    burst_factor: float = 3.0
    suspend_factor: float = 2.0
    violations_window_s: float = 600.0
    violations_flag: int = 3
    violations_suspend: int = 6
    velocity_window_s: float = 60.0
    velocity_factor: float = 3.0
    addresses_window_s: float = 300.0
    addresses_flag: int = 5
    addresses_suspend: int = 20

    def limit(self, tier: str) -> TierLimit:
        return self.tiers.get(tier, self.tiers["free"])


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
    processors: ProcessorSettings = Field(default_factory=ProcessorSettings)
    safety: SafetySettings = Field(default_factory=SafetySettings)
    abuse: AbuseSettings = Field(default_factory=AbuseSettings)


def load_settings(**overrides: object) -> Settings:
    """Build the settings from the environment (``KNS_*``) plus explicit overrides. Call once per process."""
    return Settings(**overrides)  # type: ignore[arg-type]
