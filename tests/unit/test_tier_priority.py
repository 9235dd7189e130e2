"""A tier's requests go to the work queue of its priority class, and ``KNS_TENANCY__TIERS__<TIER>__PRIORITY`` moves
the tier to another class (``stream_processors.safety.policy.work_queue``: how the safety pre-filter routes what it
admits). tests/e2e/test_tier_priority.py follows requests to the topic they land on."""

from __future__ import annotations

import pytest

from runtime.settings import load_settings
from runtime.tenancy import work_queue
from schemas.events import ChatRequest
from schemas.topics import TOPICS
from tests.unit.test_safety_policy import request


def of(tier: str) -> ChatRequest:
    return request(("user", "Hi")).model_copy(update={"tier": tier})


def test_each_tier_goes_to_its_classs_work_queue_by_default() -> None:
    tiers = load_settings().tenancy.tiers
    assert work_queue(of("enterprise"), tiers) == TOPICS.requests_admitted_high
    assert work_queue(of("plus"), tiers) == TOPICS.requests_admitted
    assert work_queue(of("free"), tiers) == TOPICS.requests_admitted_low
    assert work_queue(of("no-such-tier"), tiers) == TOPICS.requests_admitted_low  # an old record's tier: the lowest


def test_a_tier_moved_to_another_class_goes_to_that_classs_work_queue(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KNS_TENANCY__TIERS__FREE__PRIORITY", "high")
    monkeypatch.setenv("KNS_TENANCY__TIERS__ENTERPRISE__PRIORITY", "low")
    tiers = load_settings().tenancy.tiers
    assert work_queue(of("free"), tiers) == TOPICS.requests_admitted_high
    assert work_queue(of("enterprise"), tiers) == TOPICS.requests_admitted_low
    assert work_queue(of("plus"), tiers) == TOPICS.requests_admitted  # the others stay where they were
    # what the worker then makes of it: the high class's queue is the first it serves
    assert TOPICS.work_queues()[0] == work_queue(of("free"), tiers)


def test_an_unknown_class_fails_at_startup(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KNS_TENANCY__TIERS__FREE__PRIORITY", "urgent")
    with pytest.raises(ValueError, match="priority"):
        load_settings()
