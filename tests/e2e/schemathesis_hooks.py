"""Schemathesis hooks for ``test_openapi_contract``: keep every generated request cheap on a 2-core CPU, and let
the stateful phase's chains reach stored objects.

Loaded by the ``st`` subprocess through ``SCHEMATHESIS_HOOKS`` (a file path), never imported by pytest. Only values
that do not decide whether a body is valid change, and only in the bodies of the two operations that generate
(``POST /v1/chat/completions``, ``POST /v1/responses``):

* an integer token count above the cap is lowered to it (a missing one is added, otherwise the gateway would allow
  the whole context), and ``min_tokens`` follows it down;
* a string ``model`` becomes the served one (``KNS_ST_MODEL``), so that valid bodies reach the engine instead of a
  404, and a ``logit_bias`` key (a token id) one of its tokens (below ``KNS_ST_VOCABULARY``: the document cannot
  say which model's ids are valid);
* in the stateful phase, a valid create is stored (``store: true``): its links lead to reads, cancels and deletes of
  a stored object, which a completion that is not stored is not (a 404 there is right, and says nothing).

A body that is invalid because of a token count stays invalid (wrong types and values below 1 are kept).
"""

from __future__ import annotations

import copy
import os
import re
from typing import Any

import schemathesis
from schemathesis.generation.meta import TestPhase

#: At most this many completion tokens per generated request.
MAX_TOKENS = 4
#: each generating operation's token counts: the first is the one added when none is given
TOKEN_FIELDS = {
    "/v1/chat/completions": ("max_completion_tokens", "max_tokens"),
    "/v1/responses": ("max_output_tokens",),
}


def _is_number(value: object) -> bool:
    # JSON Schema's integers include 4.0, and schemathesis sends such floats for integer fields
    return isinstance(value, int | float) and not isinstance(value, bool)


def cap_tokens(body: dict[str, Any], fields: tuple[str, ...]) -> None:
    counts = [name for name in fields if _is_number(body.get(name))]
    for name in counts:
        if body[name] > MAX_TOKENS:
            body[name] = MAX_TOKENS
    if not counts and all(body.get(name) is None for name in fields):
        body[fields[0]] = MAX_TOKENS
    ceiling = min([MAX_TOKENS, *(body[name] for name in counts)])
    if _is_number(body.get("min_tokens")) and body["min_tokens"] > ceiling:
        body["min_tokens"] = ceiling


def served_model(body: dict[str, Any]) -> None:
    if isinstance(body.get("model"), str):
        body["model"] = os.environ["KNS_ST_MODEL"]


def served_tokens(body: dict[str, Any]) -> None:
    bias = body.get("logit_bias")
    if isinstance(bias, dict):
        vocabulary = int(os.environ["KNS_ST_VOCABULARY"])
        body["logit_bias"] = {str(int(token) % vocabulary) if re.fullmatch("[1-9][0-9]*", token) else token: value
                              for token, value in bias.items()}


def stored(body: dict[str, Any]) -> None:
    if body.get("store") in (None, False):
        body["store"] = True


@schemathesis.hook
def before_call(context: schemathesis.HookContext, case: schemathesis.Case, kwargs: dict[str, Any]) -> None:
    operation = case.operation
    fields = TOKEN_FIELDS.get(operation.path)
    if operation.method.upper() != "POST" or fields is None or not isinstance(case.body, dict):
        return
    # A copy: the coverage phase builds its cases from shared dictionaries.
    body = copy.deepcopy(case.body)
    cap_tokens(body, fields)
    served_model(body)
    served_tokens(body)
    meta = case.meta
    if meta is not None and meta.phase.name == TestPhase.STATEFUL and meta.generation.mode.is_positive:
        stored(body)
    case.body = body
