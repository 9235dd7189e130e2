"""Ids of the Responses and Conversations APIs, in OpenAI's shapes (``resp_…``, ``conv_…``, ``msg_…``).

Item ids derive from the id of the request that carried them, so a redelivered record rewrites the same rows:
the conversation writer's idempotence rests on that.
"""

from __future__ import annotations

import re
import uuid

RESPONSE_PREFIX = "resp_"
CONVERSATION_PREFIX = "conv_"
ITEM_PREFIX = "msg_"
_PLAUSIBLE = re.compile(r"[A-Za-z0-9_\-]{1,128}")


def new_response_id() -> str:
    return f"{RESPONSE_PREFIX}{uuid.uuid4().hex}"


def new_conversation_id() -> str:
    return f"{CONVERSATION_PREFIX}{uuid.uuid4().hex}"


def _stem(request_id: str) -> str:
    return request_id.split("_", 1)[-1].split("-", 1)[-1]


def input_item_id(request_id: str, index: int) -> str:
    """The ``index``-th input item of the turn carried by ``request_id``."""
    return f"{ITEM_PREFIX}{_stem(request_id)}_{index}"


def output_item_id(request_id: str) -> str:
    """The assistant's answer of the turn carried by ``request_id``."""
    return f"{ITEM_PREFIX}{_stem(request_id)}_out"


def plausible(value: str, prefix: str) -> bool:
    """Whether ``value`` can be an id of this kind (a cheap check before a lookup: junk gets 404 at once)."""
    return value.startswith(prefix) and _PLAUSIBLE.fullmatch(value) is not None
