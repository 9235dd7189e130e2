"""``/tokenize``'s work on a long input stays off the gateway's event loop (``tokenization.py``: "Long inputs are
tokenized in a thread, as prompts are"; DEVELOPERS.md: no blocking call on an event loop).

A prompt near the gateway's body limit (``gateway.max_body_bytes``, 1 MiB) is about a million tokens (one digit
or CJK character each); ``convert_ids_to_tokens`` of a million ids takes 0.2-0.4 s here, and with
``return_token_strs`` it ran on the loop after the encoding's thread had returned: every stream of the gateway
stalled that long, once per call that the key's read bucket admits.
"""

from __future__ import annotations

import threading
from typing import Any

import orjson
import pytest

from producers.gateway.admission import Admission
from producers.gateway.local_limiter import LocalLimiter
from producers.gateway.prompt import INLINE_RENDER_CHARS, PromptBuilder
from producers.gateway.routes.tokenize import parse_tokenize
from producers.gateway.tokenization import Tokenization
from runtime.settings import ModelSettings, TierTable
from tests.fakes.tenancy import api_key

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
async def prompts() -> PromptBuilder:
    return await PromptBuilder.load(ModelSettings())


async def test_the_token_strings_of_a_long_prompt_are_made_off_the_event_loop(prompts: PromptBuilder,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    loop_thread = threading.get_ident()
    made_on: list[int] = []
    token_strings = prompts.token_strings

    def recorded(ids: list[int]) -> Any:
        made_on.append(threading.get_ident())
        return token_strings(ids)

    monkeypatch.setattr(prompts, "token_strings", recorded)
    tokenization = Tokenization(prompts, Admission(LocalLimiter(), LocalLimiter(), TierTable.model_validate({})))
    raw = orjson.dumps({"prompt": "7" * (INLINE_RENDER_CHARS * 50), "return_token_strs": True})

    answer = await tokenization.tokenize(api_key(), lambda: parse_tokenize(raw))

    assert answer.token_strs is not None and len(answer.token_strs) == answer.count >= INLINE_RENDER_CHARS * 50
    assert made_on and loop_thread not in made_on, "a long prompt's token strings were made on the event loop"


async def test_a_long_detokenize_body_is_parsed_off_the_event_loop(prompts: PromptBuilder,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A 1 MiB body holds about 500,000 ids; validating them (``INTEGRAL``, a Python validator per item) takes
    70-100 ms here, on the loop: a chat completion's 1 MiB of text parses in about 2 ms."""
    from starlette.requests import Request

    from producers.gateway.routes import tokenize as routes

    loop_thread = threading.get_ident()
    parsed_on: list[int] = []
    parse_json = routes.parse_json

    def recorded(raw: bytes, model: Any) -> Any:
        parsed_on.append(threading.get_ident())
        return parse_json(raw, model)

    monkeypatch.setattr(routes, "parse_json", recorded)
    raw = orjson.dumps({"tokens": [1] * 500_000})

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": raw, "more_body": False}

    request = Request({"type": "http", "method": "POST", "path": "/detokenize", "headers": []}, receive)
    tokenization = Tokenization(prompts, Admission(LocalLimiter(), LocalLimiter(), TierTable.model_validate({})))
    ctx: Any = type("Context", (), {"tokenization": tokenization})()

    answer = await routes.detokenize(request, ctx, api_key())

    assert answer.prompt == "<|im_start|>" * 500_000
    assert parsed_on and loop_thread not in parsed_on, "a 500,000-id body was validated on the event loop"
