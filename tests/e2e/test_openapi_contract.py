"""The gateway's ``/openapi.json`` is the contract: schemathesis, with every check (``--checks all``) and its stateful
phase following the document's links, finds nothing wrong anywhere in the API on the real stack.

Schemathesis sends requests the document allows (each must be answered 2xx, or 401/403/404/409/429) and requests it
forbids (each must be refused with a 4xx), checks every answer against the declared statuses, media types, headers
and schemas, a 405 for undeclared methods and a 401 without the key; its stateful phase chains each create to the
reads, cancels and deletes of what it created (OpenAPI ``links``: a created object must be found, a deleted one must
be gone). Two runs: the whole document, every phase; then the stateful phase alone on the two operations that
generate and their operations by id (schemathesis starts chains from them only when no other operation looks like a
better start). Bounded for a 2-core CPU: a fixed seed, few examples, one connection, and ``schemathesis_hooks.py``
caps every generation at a handful of tokens.

What the document cannot say, and the run is told (``CONFIG``): a body over the gateway's size limit is refused with
413 (a rejection, which schemathesis's default list of rejections lacks); ``GET /v1/usage`` refuses a range that ends
before it starts or spans more than 93 days (a rule across two parameters and the clock); cancelling a response that
already ended is a 409 (a rule on the response's state); ``/tokenize`` refuses ``continue_final_message`` with an
explicit ``add_generation_prompt: true`` (two fields), ``/detokenize`` an id past the model's vocabulary (the
loaded tokenizer's size).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

import orjson
import pytest

from tests.conftest import SESSION, Caller
from tests.e2e.conftest import MODEL

pytestmark = pytest.mark.e2e

HOOKS = Path(__file__).with_name("schemathesis_hooks.py")
REJECTIONS = ["400", "401", "403", "404", "405", "406", "409", "413", "415", "422", "428", "429", "5xx"]
#: what the document cannot say: the status each of these operations also answers to a body or query it allows
BEYOND_THE_SCHEMA = {"getUsage": "400", "cancelResponse": "409", "tokenize": "400", "detokenize": "400"}
ACCEPTED = ["2xx", "401", "403", "404", "429"]
CONFIG = f"""
[generation]
max-examples = 10

[checks.negative_data_rejection]
expected-statuses = {REJECTIONS}

[phases.stateful]
max-steps = 8
# the document's own links only: inferred ones would spread the chains over guesses
inference.algorithms = []

[phases.stateful.generation]
max-examples = 40
""" + "".join(f"""
[[operations]]
include-operation-id = "{operation}"
checks.positive_data_acceptance.expected-statuses = {sorted([*ACCEPTED, status])}
""" for operation, status in BEYOND_THE_SCHEMA.items())
#: the generating creates and every operation on what they create
GENERATING = ["--include-path-regex", "^/v1/(chat/completions|responses)", "--exclude-operation-id",
              "listChatCompletions"]


def generated(har: Path) -> int:
    """Requests of the run the engine answered: 200s of the two operations that generate (from its HAR report)."""
    entries = orjson.loads(har.read_bytes())["log"]["entries"]
    return sum(1 for e in entries if e["request"]["method"] == "POST" and e["response"]["status"] == 200
               and urlsplit(e["request"]["url"]).path in ("/v1/chat/completions", "/v1/responses"))


def vocabulary_size() -> int:
    """The served model's token ids are 0 to this, less one (what the document cannot say of logit_bias's keys)."""
    from tokenizers import Tokenizer

    from runtime.settings import ModelSettings

    return int(Tokenizer.from_file(str(ModelSettings().path / "tokenizer.json")).get_vocab_size(with_added_tokens=True))


def schemathesis(origin: str, caller: Caller, folder: Path, *args: str) -> str:
    """One ``st run`` on the document with every check; its output, after asserting it found nothing. Its requests
    and answers are in ``folder/run.har``."""
    command = [
        sys.executable, "-m", "schemathesis.cli", "run", f"{origin}/openapi.json", "--checks", "all",
        "--seed", "1", "--workers", "1", "--generation-database", "none", "--request-timeout", "120",
        "--no-color", "--output-truncate", "true", "--header", f"Authorization: Bearer {caller.secret}",
        "--report", "har", "--report-har-path", str(folder / "run.har"), *args,
    ]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": str(HOOKS), "KNS_ST_MODEL": MODEL, "KNS_ST_VOCABULARY":
           str(vocabulary_size()), "COLUMNS": "200"}
    folder.mkdir()
    # In a folder of its own (schemathesis reads its config there and may leave report or cache files)
    (folder / "schemathesis.toml").write_text(CONFIG)
    result = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=420)
    report = result.stdout[-20_000:] + result.stderr[-4_000:]
    assert result.returncode == 0, report
    cases = re.search(r"(\d+) generated, \1 passed", result.stdout)
    assert cases and int(cases.group(1)) >= 100, report
    return result.stdout


def links_covered(output: str) -> tuple[int, int]:
    found = re.search(r"API Links:\s+(\d+) covered / (\d+) selected", output)
    assert found, output[-4_000:]
    return int(found.group(1)), int(found.group(2))


@pytest.mark.timeout(900)  # the two runs take up to 420 s each
def test_schemathesis_finds_nothing_in_the_api(base_url: str, make_caller: Callable[..., Caller],
                                               tmp_path: Path) -> None:
    # A key of its own (and an org of its own): thousands of requests must not count against the session's caller
    # (abuse windows, usage totals other tests read).
    caller: Caller = make_caller(org=f"org-schemathesis-{SESSION}", tier="enterprise")
    origin = base_url.removesuffix("/v1")
    started = time.monotonic()
    whole = schemathesis(origin, caller, tmp_path / "whole")
    print(f"schemathesis, the whole document: {time.monotonic() - started:.0f} s")
    # Valid bodies reached the engine, so the 200 answers (JSON and SSE) were checked against their schemas too.
    assert generated(tmp_path / "whole" / "run.har") >= 20, whole
    # its chains start from the conversations' create and the lists (the two generating creates look like worse
    # starts to schemathesis: the second run starts from them)
    covered, selected = links_covered(whole)
    assert selected >= 17 and covered >= 5, whole

    started = time.monotonic()
    chained = schemathesis(origin, caller, tmp_path / "stateful", "--phases", "stateful", *GENERATING)
    print(f"schemathesis, stateful on the generating creates: {time.monotonic() - started:.0f} s")
    covered, selected = links_covered(chained)
    # each create led to a read, a cancel and a delete of what it created (and a response to its input items)
    assert selected == 10 and covered >= 8, chained
    assert generated(tmp_path / "stateful" / "run.har") >= 20, chained
