"""One settings object: nested environment variables, device-dependent engine defaults, namespaces."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from runtime.settings import EngineSettings, KafkaSettings, Settings, load_settings


def test_nested_environment_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KNS_KAFKA__BOOTSTRAP_SERVERS", "broker:9092")
    monkeypatch.setenv("KNS_GATEWAY__PORT", "9001")
    monkeypatch.delenv("KNS_GATEWAY__INSTANCE_ID", raising=False)
    s = load_settings()
    assert s.kafka.bootstrap_servers == "broker:9092"
    assert s.gateway.port == 9001
    assert s.gateway.instance_id.endswith(":9001")


def test_cpu_engine_defaults_are_sized() -> None:
    eff = EngineSettings(device="cpu").effective()
    assert eff.dtype == "float32"  # bf16 answers garbage on the CPU build
    assert eff.kv_cache_memory_bytes and eff.kv_cache_memory_bytes <= 1 << 30
    assert eff.max_num_seqs == 16 and eff.enforce_eager is True


def test_gpu_engine_defaults() -> None:
    eff = EngineSettings(device="cuda").effective()
    assert (eff.dtype, eff.kv_cache_memory_bytes, eff.enforce_eager) == ("bfloat16", None, False)


def test_explicit_engine_values_win() -> None:
    eff = EngineSettings(device="cpu", dtype="bfloat16", max_num_seqs=4, enforce_eager=False).effective()
    assert (eff.dtype, eff.max_num_seqs, eff.enforce_eager) == ("bfloat16", 4, False)


def test_namespace_prefixes_topics_and_groups() -> None:
    assert KafkaSettings(namespace="t1").topic("llm.tokens.emitted.v1") == "t1.llm.tokens.emitted.v1"
    assert KafkaSettings().group("inference-workers") == "inference-workers"


def test_one_setting_of_one_tier_changes_only_that(monkeypatch: pytest.MonkeyPatch) -> None:
    """A nested variable arrives as {"free": {"queue_deadline_s": ...}}: without merging it over the defaults it
    would drop the tier's rates (a start-up error) or every other tier (unknown tiers)."""
    monkeypatch.setenv("KNS_TENANCY__TIERS__FREE__QUEUE_DEADLINE_S", "5")
    monkeypatch.setenv("KNS_TENANCY__TIERS__ENTERPRISE__REQUESTS_PER_MINUTE", "9000")
    tiers = load_settings().tenancy.tiers
    assert list(tiers.policies()) == ["free", "plus", "enterprise"]
    assert (tiers.free.queue_deadline_s, tiers.free.requests_per_minute) == (5.0, 30)
    assert (tiers.enterprise.requests_per_minute, tiers.enterprise.tokens_per_minute) == (9000, 5_000_000)
    assert tiers.policy("no-such-tier") == tiers.free


def test_an_in_flight_lease_shorter_than_the_longest_wait_is_refused_at_start() -> None:
    with pytest.raises(ValidationError, match=r"tenancy\.lease_s"):
        Settings(tenancy={"lease_s": 60.0})  # type: ignore[arg-type]


def test_a_resume_window_as_long_as_the_streams_resume_ttl_fails_at_start_up() -> None:
    """A client dropped near the end of such a window would find its stream record gone: 404 instead of the rest."""
    with pytest.raises(ValueError, match="resume_window_s"):
        Settings(gateway={"resume_ttl_s": 60, "resume_window_s": 60})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"tiers\.free\.resume_window_s"):
        Settings(tenancy={"tiers": {"free": {"resume_window_s": 900}}})  # type: ignore[arg-type]
    assert Settings(gateway={"resume_window_s": 0}).gateway.resume_window_s == 0  # type: ignore[arg-type]
