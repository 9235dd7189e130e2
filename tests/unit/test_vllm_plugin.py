"""Our vLLM plugin caps how long vLLM's message-queue readers spin when, and only when, its variable is set; the
worker sets it from the engine settings (CPU default 5 ms, vLLM's own on a GPU), and vLLM can find the plugin."""

from __future__ import annotations

from collections.abc import Iterator
from importlib.metadata import entry_points

import pytest
import zmq
from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

from inference_workers import vllm_plugin
from inference_workers.engine import engine_env
from inference_workers.vllm_plugin import IDLE_SPIN_ENV, register
from runtime.settings import EngineSettings


@pytest.fixture
def pristine(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Whatever a test does to SpinCondition is undone after it."""
    monkeypatch.setattr(SpinCondition, "__init__", SpinCondition.__init__)
    monkeypatch.setattr(SpinCondition, vllm_plugin._PATCHED, None, raising=False)
    yield


def reader_spin_s() -> float:
    context = zmq.Context()
    reader = SpinCondition(is_reader=True, context=context, notify_address="inproc://kns-test-notify")
    # Closed before the context: a socket left to the garbage collector after it aborts the interpreter.
    for socket in (reader.local_notify_socket, reader.read_cancel_socket, reader.write_cancel_socket):
        socket.close(linger=0)
    context.term()
    return float(reader.busy_loop_s)


def test_unset_leaves_vllm_as_it_is(pristine: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(IDLE_SPIN_ENV, raising=False)
    register()
    assert reader_spin_s() == 1


def test_set_caps_every_reader_built_after(pristine: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(IDLE_SPIN_ENV, "0.005")
    register()
    register()  # vLLM may load a plugin more than once in one process
    assert reader_spin_s() == 0.005
    monkeypatch.setenv(IDLE_SPIN_ENV, "0.25")
    register()
    assert reader_spin_s() == 0.25


def test_a_value_that_is_not_a_number_is_ignored(pristine: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(IDLE_SPIN_ENV, "soon")
    register()
    assert reader_spin_s() == 1


def test_vllm_finds_the_plugin() -> None:
    found = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert found.get("kns_idle_spin") == "inference_workers.vllm_plugin:register"


def test_the_engine_environment_follows_the_device() -> None:
    assert engine_env(EngineSettings(device="cpu")) == {IDLE_SPIN_ENV: "0.005"}
    assert engine_env(EngineSettings(device="cuda")) == {}
    assert engine_env(EngineSettings(device="cuda", idle_spin_s=0.002)) == {IDLE_SPIN_ENV: "0.002"}
    assert engine_env(EngineSettings(device="cpu", idle_spin_s=1.0)) == {IDLE_SPIN_ENV: "1.0"}
