"""Structured outputs: the JSON schema every answer of a request must validate against (chat's ``response_format``,
the Responses API's ``text.format``), checked before anything is admitted or queued.

The worker's engine decodes under the schema's grammar with llguidance (vLLM's ``guidance`` backend,
``inference_workers/engine.py``). The gateway asks the same library whether it can build that grammar, so a schema
accepted here never fails a generation, and one it cannot build is a 400 naming the parameter, with llguidance's
reason. Clients send the same schema with every request: verdicts are remembered by the schema's text. Building
a grammar can take a second even for a schema of a few hundred bytes (``allOf`` over ``anyOf``), so every new schema
is checked in a thread of its own, off the event loop and away from the threads tokenizing prompts.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import orjson
from llguidance import LLMatcher

from producers.gateway.errors import bad_request

#: JSON mode (``json_object``): any JSON object, as OpenAI's
JSON_OBJECT_SCHEMA = '{"type":"object"}'
#: a schema's JSON text at most (OpenAI bounds a schema's names and values at 120,000 characters in all)
MAX_SCHEMA_BYTES = 128 * 1024
#: objects and arrays nested at most this deep (vLLM's bound: building a grammar grows steeply with nesting)
MAX_NESTING = 64
#: the ``minItems`` and ``maxItems`` of a schema add up to at most this: llguidance spells an array's bounds out item
#: by item before any of its own limits apply (10,000: ~30 ms; a ``maxItems`` of 10,000,000: a minute, and a
#: ``minItems`` of 2**31 - 1 gigabytes until the process is killed)
MAX_ARRAY_BOUNDS = 10_000
#: llguidance's options read from the schema itself (whitespace, separators, ``lenient``: keywords it does not
#: implement ignored): the server's to set, not a client's
GRAMMAR_OPTIONS = "x-guidance"
#: verdicts remembered (the least recently used forgotten first)
REMEMBERED_VERDICTS = 1024


class SchemaChecker:
    """Whether the engine can decode under a JSON schema; remembers its verdicts."""

    def __init__(self, remembered: int = REMEMBERED_VERDICTS) -> None:
        self._remembered = remembered
        #: the schema text's SHA-256 -> "" (usable) or why not
        self._verdicts: OrderedDict[bytes, str] = OrderedDict()
        #: one grammar built at a time: a flood of costly schemas waits here, not in the threads prompts use
        self._builder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="schema-check")

    async def check(self, schema: dict[str, Any], *, param: str, name: str | None = None) -> str:
        """The schema as the JSON text the worker decodes with, or a 400 naming ``param``."""
        if _nesting_exceeds(schema, MAX_NESTING):
            raise invalid_schema(param, name, f"objects and arrays may nest at most {MAX_NESTING} levels")
        if (bounds := _array_bounds(schema)) > MAX_ARRAY_BOUNDS:
            raise invalid_schema(param, name, f"its minItems and maxItems add up to {bounds}, and at most "
                                              f"{MAX_ARRAY_BOUNDS} are accepted")
        if GRAMMAR_OPTIONS in schema:
            raise invalid_schema(param, name, f"'{GRAMMAR_OPTIONS}' is not accepted: the server sets how answers "
                                              "are decoded")
        text = orjson.dumps(schema).decode()
        if len(text) > MAX_SCHEMA_BYTES:
            raise invalid_schema(param, name, f"it is {len(text)} bytes long, and at most {MAX_SCHEMA_BYTES} are "
                                              "accepted")
        digest = hashlib.sha256(text.encode()).digest()  # what is remembered: 1,024 large schemas would be MBs
        why = self._verdicts.get(digest)
        if why is None:
            why = await asyncio.get_running_loop().run_in_executor(self._builder, grammar_error, text)
            self._remember(digest, why)
        else:
            self._verdicts.move_to_end(digest)
        if why:
            raise invalid_schema(param, name, why)
        return text

    def _remember(self, digest: bytes, why: str) -> None:
        self._verdicts[digest] = why
        while len(self._verdicts) > self._remembered:
            self._verdicts.popitem(last=False)


def grammar_error(schema_text: str) -> str:
    """Blocking: "" when llguidance builds a grammar from the schema (compact JSON, as the worker decodes), else
    why not."""
    try:
        grammar = LLMatcher.grammar_from_json_schema(schema_text, defaults={"whitespace_flexible": False})
    except (ValueError, TypeError) as exc:
        return str(exc)
    return str(LLMatcher.validate_grammar(grammar, None))


def _nesting_exceeds(node: Any, limit: int) -> bool:
    """Whether objects and arrays nest deeper than ``limit`` (walked a level at a time, never recursively)."""
    level = [node]
    for _ in range(limit):
        level = [child for parent in level if isinstance(parent, dict | list)
                 for child in (parent.values() if isinstance(parent, dict) else parent)]
        if not level:
            return False
    return any(isinstance(child, dict | list) for child in level)


def _array_bounds(node: Any) -> int:
    """The sum of every ``minItems`` and ``maxItems`` in a schema (walked a level at a time, never recursively)."""
    total, level = 0, [node]
    while level:
        # a negative bound (llguidance refuses it) must not offset a large one
        total += sum(max(value, 0) for parent in level if isinstance(parent, dict)
                     for key in ("minItems", "maxItems") if type(value := parent.get(key)) is int)
        level = [child for parent in level if isinstance(parent, dict | list)
                 for child in (parent.values() if isinstance(parent, dict) else parent)]
    return total


def invalid_schema(param: str, name: str | None, why: str) -> Exception:
    which = f" '{name}'" if name else ""
    return bad_request(f"Invalid schema for {param.split('.')[0]}{which}: {why.strip()}", param=param,
                       code="invalid_json_schema")
