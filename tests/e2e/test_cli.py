"""Operators see every token of an answer in Kafka with `kns tokens`."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import openai
import pytest

from runtime.settings import REPO_ROOT, Settings
from tests.e2e.conftest import MODEL, QUESTION, token_records

pytestmark = pytest.mark.e2e


async def test_kns_tokens_shows_the_records_of_a_request(client: openai.OpenAI, stack: Settings,
                                                        service_env: dict[str, str]) -> None:
    answer = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=16)
    # The answer came back through the relay (read_uncommitted), so every one of its records is in the log now.
    records = await token_records(stack, answer.id)
    assert sum(len(e.token_ids) for _, e in records) == answer.usage.completion_tokens
    out = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "ops.cli", "tokens", "--request-id", answer.id, "--since", "600"],
        cwd=REPO_ROOT, env={**service_env, "COLUMNS": "250"}, capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == f"{len(records)} token events", out.stdout
    for word in ("Paris", "stop"):
        assert word in out.stdout
