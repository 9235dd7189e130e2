"""Operators see every token of an answer in Kafka with `kns tokens`."""

from __future__ import annotations

import subprocess
import sys

import openai
import pytest

from runtime.settings import REPO_ROOT
from tests.e2e.conftest import MODEL, QUESTION

pytestmark = pytest.mark.e2e


def test_kns_tokens_shows_the_records_of_a_request(client: openai.OpenAI, service_env: dict[str, str]) -> None:
    answer = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=16)
    out = subprocess.run(
        [sys.executable, "-m", "ops.cli", "tokens", "--request-id", answer.id, "--since", "600"],
        cwd=REPO_ROOT, env={**service_env, "COLUMNS": "250"}, capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert f"{answer.usage.completion_tokens} token events" in out.stdout or "token events" in out.stdout
    for word in ("Paris", "stop"):
        assert word in out.stdout
