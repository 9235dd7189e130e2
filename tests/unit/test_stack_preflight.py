"""The stack manager explains what is missing instead of failing obscurely."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from ops.stack.manager import StackManager
from ops.stack.services import StackError, java_binary
from runtime.settings import Settings, StackSettings


def manager(tmp_path: Path, **stack: object) -> StackManager:
    settings = Settings(stack=StackSettings(root=tmp_path, **stack))  # type: ignore[arg-type]
    settings.redis.url = f"redis://127.0.0.1:{_free_port()}/0"
    return StackManager(settings)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_port_in_use_is_named(tmp_path: Path) -> None:
    m = manager(tmp_path)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        m.settings.redis.url = f"redis://127.0.0.1:{port}/0"
        with pytest.raises(StackError, match=f"port {port} \\(needed by redis\\) is already in use"):
            m._preflight([s for s in m.services if s.name == "redis"])


def test_too_little_disk_is_reported(tmp_path: Path) -> None:
    m = manager(tmp_path, min_free_disk_gb=10**9)
    with pytest.raises(StackError, match="GB free"):
        m._preflight(m.services)


def test_missing_java_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(StackError, match="Java is not installed"):
        java_binary()
