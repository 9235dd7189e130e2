"""Our vLLM plugin caps how long vLLM's message-queue readers spin when, and only when, its variable is set; the
worker sets it from the engine settings (CPU default 5 ms, vLLM's own on a GPU), and vLLM can find the plugin.

vLLM is imported by the tests that use it (the ``shm_broadcast`` and ``titled`` fixtures, marked ``vllm``), never
at collection: the fast lane (``pytest -m unit``) collects this module too and must not load it."""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Iterator
from importlib.metadata import entry_points
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from inference_workers import vllm_plugin
from inference_workers.engine import engine_env
from inference_workers.vllm_plugin import ENGINE_CORE_NAP_ENV, IDLE_SPIN_ENV, nap_in_engine_core, register
from runtime.settings import EngineSettings


def _vllm_like_init(self: Any, is_reader: bool, context: object, notify_address: str) -> None:
    """What vLLM's own ``SpinCondition.__init__`` does that matters here (see the test of its source below),
    without its zmq sockets: a test process that builds and terminates real zmq contexts aborted now and then in
    ``Context.term`` (CI, and once here)."""
    self.is_reader = is_reader
    self.busy_loop_s = 1


@pytest.fixture(scope="module")
def shm_broadcast() -> ModuleType:
    """vLLM's shared-memory message queues, where ``SpinCondition`` lives."""
    from vllm.distributed.device_communicators import shm_broadcast

    return shm_broadcast


@pytest.fixture
def pristine(shm_broadcast: ModuleType, monkeypatch: pytest.MonkeyPatch) -> Iterator[type]:
    """SpinCondition with a socket-free ``__init__``; whatever a test does to it is undone after it."""
    spin_condition = shm_broadcast.SpinCondition
    monkeypatch.setattr(spin_condition, "__init__", _vllm_like_init)
    monkeypatch.setattr(spin_condition, vllm_plugin._PATCHED, None, raising=False)
    monkeypatch.setattr(shm_broadcast, "sched_yield", shm_broadcast.sched_yield)
    monkeypatch.setattr(shm_broadcast, vllm_plugin._ORIGINAL_YIELD, None, raising=False)
    monkeypatch.delenv(IDLE_SPIN_ENV, raising=False)
    monkeypatch.delenv(ENGINE_CORE_NAP_ENV, raising=False)
    yield spin_condition


@pytest.fixture
def titled() -> Iterator[Callable[[str], None]]:
    """Title this process with vLLM's own ``set_process_title`` (``VLLM::<name>``), as vLLM's processes are;
    restored after."""
    import setproctitle
    from vllm.utils.system_utils import set_process_title

    before = setproctitle.getproctitle()
    yield set_process_title
    setproctitle.setproctitle(before)


def reader_spin_s(spin_condition: type) -> float:
    reader = spin_condition.__new__(spin_condition)
    reader.__init__(is_reader=True, context=None, notify_address="inproc://kns-test-notify")  # type: ignore[misc]
    return float(reader.busy_loop_s)


@pytest.mark.vllm
def test_vllm_s_readers_spin_a_second_by_busy_loop_s(shm_broadcast: ModuleType) -> None:
    """The attribute the plugin overrides is the one vLLM's readers spin by (what the stub above mirrors)."""
    spin_condition = shm_broadcast.SpinCondition
    init, wait = inspect.getsource(spin_condition.__init__), inspect.getsource(spin_condition.wait)
    assert "busy_loop_s: float = 1," in init and "self.busy_loop_s = busy_loop_s" in init
    assert "self.last_read + self.busy_loop_s" in wait


@pytest.mark.vllm
def test_unset_leaves_vllm_as_it_is(pristine: type, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(IDLE_SPIN_ENV, raising=False)
    register()
    assert reader_spin_s(pristine) == 1


@pytest.mark.vllm
def test_set_caps_every_reader_built_after(pristine: type, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(IDLE_SPIN_ENV, "0.005")
    register()
    register()  # vLLM may load a plugin more than once in one process
    assert reader_spin_s(pristine) == 0.005
    monkeypatch.setenv(IDLE_SPIN_ENV, "0.25")
    register()
    assert reader_spin_s(pristine) == 0.25


@pytest.mark.vllm
@pytest.mark.parametrize("value", ["soon", "0", "0.001", "inf", "nan", "-1"])
def test_a_spin_out_of_the_settings_bounds_is_ignored(pristine: type, monkeypatch: pytest.MonkeyPatch,
                                                      value: str) -> None:
    """Set by hand, as the settings would refuse it: under 3 ms vLLM's readers lose wake-ups (DEVELOPERS.md)."""
    monkeypatch.setenv(IDLE_SPIN_ENV, value)
    register()
    assert reader_spin_s(pristine) == 1


@pytest.mark.vllm
@pytest.mark.parametrize("value", ["soon", "0", "-1", "0.2", "inf", "nan"])
def test_a_nap_out_of_the_settings_bounds_is_ignored(shm_broadcast: ModuleType, pristine: type,
                                                     monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    """0.2 is someone thinking in milliseconds: 200 ms per look would make every step that late; inf would raise
    in the engine core's read loop and kill it."""
    vllm_s = shm_broadcast.sched_yield
    monkeypatch.setenv(ENGINE_CORE_NAP_ENV, value)
    register()
    assert shm_broadcast.sched_yield is vllm_s


@pytest.mark.vllm
def test_vllm_s_spinning_in_c_is_reported(shm_broadcast: ModuleType, pristine: type, monkeypatch: pytest.MonkeyPatch,
                                          caplog: pytest.LogCaptureFixture) -> None:
    """With VLLM_USE_SPINLOOP_EXT the readers spin in C first, where neither setting reaches."""
    monkeypatch.setattr(shm_broadcast, "SPINLOOP_EXT_ENABLED", True)
    monkeypatch.setenv(ENGINE_CORE_NAP_ENV, "0.0002")
    register()
    assert "VLLM_USE_SPINLOOP_EXT" in caplog.text


def test_vllm_finds_the_plugin() -> None:
    found = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert found.get("kns_idle_spin") == "inference_workers.vllm_plugin:register"


def test_the_engine_environment_follows_the_device() -> None:
    assert engine_env(EngineSettings(device="cpu")) == {IDLE_SPIN_ENV: "0.005", ENGINE_CORE_NAP_ENV: "0.0002"}
    assert engine_env(EngineSettings(device="cuda")) == {}
    assert engine_env(EngineSettings(device="cuda", idle_spin_s=0.004)) == {IDLE_SPIN_ENV: "0.004"}
    assert engine_env(EngineSettings(device="cpu", idle_spin_s=1.0, engine_core_nap_s=0.0005)) == {
        IDLE_SPIN_ENV: "1.0", ENGINE_CORE_NAP_ENV: "0.0005"}


@pytest.mark.parametrize("seconds", [0, 0.001])
def test_a_spin_that_would_lose_vllm_s_wake_ups_is_refused(seconds: float) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        EngineSettings(idle_spin_s=seconds)
    assert EngineSettings(idle_spin_s=0.003).idle_spin_s == 0.003


def _spinner_module() -> tuple[SimpleNamespace, list[str]]:
    yields: list[str] = []
    return SimpleNamespace(sched_yield=lambda: yields.append("sched_yield")), yields


def _one_look(module: SimpleNamespace) -> float:
    started = time.perf_counter()
    module.sched_yield()
    return time.perf_counter() - started


@pytest.mark.vllm
def test_the_engine_core_naps_between_looks_instead_of_yielding(titled: Callable[[str], None]) -> None:
    module, yields = _spinner_module()
    titled("EngineCore")
    nap_in_engine_core(module, 0.02)  # type: ignore[arg-type]
    nap_in_engine_core(module, 0.02)  # type: ignore[arg-type]  (loaded twice: still one nap, no nesting)
    assert _one_look(module) >= 0.019
    assert yields == []


@pytest.mark.vllm
@pytest.mark.parametrize("title", ["Worker", "Worker_TP1", "APIServer", "DPCoordinator"])
def test_other_processes_keep_sched_yield(titled: Callable[[str], None], title: str) -> None:
    module, yields = _spinner_module()
    titled(title)
    nap_in_engine_core(module, 0.02)  # type: ignore[arg-type]
    assert _one_look(module) < 0.019
    assert yields == ["sched_yield"]


@pytest.mark.vllm
@pytest.mark.parametrize("title", ["EngineCore", "EngineCore_DP1"])
def test_the_nap_is_decided_at_the_first_spin_not_at_loading(titled: Callable[[str], None], title: str) -> None:
    """vLLM may load plugins in the engine core's process before it titles it."""
    import setproctitle

    module, yields = _spinner_module()
    setproctitle.setproctitle("python")
    nap_in_engine_core(module, 0.02)  # type: ignore[arg-type]
    titled(title)
    assert _one_look(module) >= 0.019 and yields == []


@pytest.mark.vllm
def test_register_naps_vllm_s_spinners_only_when_asked(shm_broadcast: ModuleType, pristine: type,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    vllm_s = shm_broadcast.sched_yield
    monkeypatch.setenv(IDLE_SPIN_ENV, "0.005")
    register()
    assert shm_broadcast.sched_yield is vllm_s
    monkeypatch.setenv(ENGINE_CORE_NAP_ENV, "0.0002")
    register()
    assert shm_broadcast.sched_yield is not vllm_s
    assert getattr(shm_broadcast, vllm_plugin._ORIGINAL_YIELD) is vllm_s


@pytest.mark.vllm
def test_vllm_s_spinners_call_the_module_s_sched_yield(shm_broadcast: ModuleType) -> None:
    """What the nap replaces: the name the readers' spin looks up in the module's globals at each call."""
    assert "sched_yield()" in inspect.getsource(shm_broadcast.SpinCondition.wait)
    assert shm_broadcast.SpinCondition.wait.__globals__ is vars(shm_broadcast)


@pytest.mark.parametrize("seconds", [0, 0.002])
def test_a_nap_that_is_not_a_short_sleep_is_refused(seconds: float) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        EngineSettings(engine_core_nap_s=seconds)
