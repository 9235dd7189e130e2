"""The gateway's ``/openapi.json`` is the contract: schemathesis, with every check (``--checks all``), finds nothing
wrong with ``POST /v1/chat/completions`` on the real stack.

Schemathesis sends bodies the schema allows (each must be answered 2xx, or 401/403/404...) and bodies it forbids
(each must be refused with a 4xx), and checks every response against the declared statuses, media types and
schemas, a 405 for undeclared methods, and a 401 without the key. Bounded for a 2-core CPU: a fixed seed, few
examples, one connection, and ``schemathesis_hooks.py`` caps every generated request at a handful of tokens.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import SESSION, Caller
from tests.e2e.conftest import MODEL, metric, scrape

pytestmark = pytest.mark.e2e

HOOKS = Path(__file__).with_name("schemathesis_hooks.py")
MAX_EXAMPLES = 10


def answered(origin: str) -> float:
    """Chat completions the engine answered (any finish reason), from the gateway's metrics."""
    text = scrape(f"{origin}/metrics")
    return sum(metric(text, "kns_gateway_requests_total", outcome=outcome, stream=stream)
               for outcome in ("stop", "length") for stream in ("true", "false"))


@pytest.mark.timeout(600)  # schemathesis runs up to 540 s
def test_schemathesis_finds_nothing_on_chat_completions(base_url: str, make_caller: Callable[..., Caller],
                                                        tmp_path: Path) -> None:
    # A key of its own (and an org of its own): hundreds of requests must not count against the session's caller
    # (abuse windows, usage totals other tests read).
    caller: Caller = make_caller(org=f"org-schemathesis-{SESSION}", tier="enterprise")
    origin = base_url.removesuffix("/v1")
    before = answered(origin)
    command = [
        sys.executable, "-m", "schemathesis.cli", "run", f"{origin}/openapi.json",
        "--include-path", "/v1/chat/completions", "--checks", "all",
        "--max-examples", str(MAX_EXAMPLES), "--seed", "1", "--workers", "1",
        "--generation-database", "none", "--request-timeout", "120", "--no-color",
        "--header", f"Authorization: Bearer {caller.secret}",
    ]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": str(HOOKS), "KNS_ST_MODEL": MODEL, "COLUMNS": "200"}
    # In a folder of its own: schemathesis may leave report or cache files where it runs.
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=540)
    report = result.stdout[-20_000:] + result.stderr[-4_000:]
    assert result.returncode == 0, report
    cases = re.search(r"(\d+) generated, \1 passed", result.stdout)
    assert cases and int(cases.group(1)) >= 100, report
    # Valid bodies reached the engine, so the 200 answers (JSON and SSE) were checked against their schemas too.
    assert answered(origin) - before >= 20, report
