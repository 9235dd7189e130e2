"""The collector's pauses are timed per generation."""

from __future__ import annotations

import gc

from runtime import gc_pauses
from runtime.metrics import GC_PAUSE


def _count(generation: str) -> float:
    return next(s.value for m in GC_PAUSE.collect() for s in m.samples
                if s.name.endswith("_count") and s.labels["generation"] == generation)


def test_a_full_collection_is_timed_once_and_watching_twice_adds_nothing() -> None:
    gc_pauses.watch()
    gc_pauses.watch()
    gc.collect(2)
    before = _count("2")
    gc.collect(2)
    assert _count("2") == before + 1
