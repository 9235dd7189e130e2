"""``/tokenize`` and ``/detokenize`` read ``model`` as vLLM's server does (``routes/tokenize.py``: "so a client
written for vLLM finds them unchanged"): vLLM's ``_is_model_supported`` takes any falsy name, the empty string
included, as the served model (``vllm/entrypoints/serve/engine/serving.py``)."""

from __future__ import annotations

import orjson
import pytest

from producers.gateway.admission import Admission
from producers.gateway.local_limiter import LocalLimiter
from producers.gateway.prompt import PromptBuilder
from producers.gateway.routes.chat import parse_json
from producers.gateway.routes.tokenize import parse_tokenize
from producers.gateway.tokenization import Tokenization
from producers.gateway.tokenize_protocol import Detokenize
from runtime.settings import ModelSettings, TierTable
from tests.fakes.tenancy import api_key

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
async def prompts() -> PromptBuilder:
    return await PromptBuilder.load(ModelSettings())


async def test_an_empty_model_name_is_the_served_model_as_vllms_server_reads_it(prompts: PromptBuilder) -> None:
    tokenization = Tokenization(prompts, Admission(LocalLimiter(), LocalLimiter(), TierTable.model_validate({})))
    prompt, ids = orjson.dumps({"model": "", "prompt": "hi"}), orjson.dumps({"model": "", "tokens": [1]})
    counted = await tokenization.tokenize(api_key(), lambda: parse_tokenize(prompt))
    text = await tokenization.detokenize(api_key(), lambda: parse_json(ids, Detokenize))
    assert counted.count == 1 and text.prompt == "<|im_start|>"
