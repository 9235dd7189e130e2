"""Schemathesis hooks for ``test_openapi_contract``: keep every generated chat request cheap on a 2-core CPU.

Loaded by the ``st`` subprocess through ``SCHEMATHESIS_HOOKS`` (a file path), never imported by pytest. Only
values that do not decide whether a body is valid change: an integer token count above the cap is lowered to it
(a missing one is added, otherwise the gateway would allow the whole context), ``min_tokens`` follows it down, and
a string ``model`` becomes the served one (``KNS_ST_MODEL``) so that valid bodies reach the engine instead of a 404.
A body that is invalid because of a token count stays invalid (wrong types and values below 1 are kept).
"""

from __future__ import annotations

import copy
import os
from typing import Any

import schemathesis

#: At most this many completion tokens per generated request.
MAX_TOKENS = 4
TOKEN_FIELDS = ("max_tokens", "max_completion_tokens")


def _is_number(value: object) -> bool:
    # JSON Schema's integers include 4.0, and schemathesis sends such floats for integer fields
    return isinstance(value, int | float) and not isinstance(value, bool)


def cap_tokens(body: dict[str, Any]) -> None:
    counts = [name for name in TOKEN_FIELDS if _is_number(body.get(name))]
    for name in counts:
        if body[name] > MAX_TOKENS:
            body[name] = MAX_TOKENS
    if not counts and all(body.get(name) is None for name in TOKEN_FIELDS):
        body["max_completion_tokens"] = MAX_TOKENS
    ceiling = min([MAX_TOKENS, *(body[name] for name in counts)])
    if _is_number(body.get("min_tokens")) and body["min_tokens"] > ceiling:
        body["min_tokens"] = ceiling


def served_model(body: dict[str, Any]) -> None:
    if isinstance(body.get("model"), str):
        body["model"] = os.environ["KNS_ST_MODEL"]


@schemathesis.hook
def before_call(context: schemathesis.HookContext, case: schemathesis.Case, kwargs: dict[str, Any]) -> None:
    if isinstance(case.body, dict):
        # A copy: the coverage phase builds its cases from shared dictionaries.
        body = copy.deepcopy(case.body)
        cap_tokens(body)
        served_model(body)
        case.body = body
