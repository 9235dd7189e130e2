"""``/tokenize`` and ``/detokenize`` on the running gateway, as a client written for vLLM's server calls them: a
chat's count is the ``prompt_tokens`` its chat completion is billed, ids read back as text, and they are behind the
API key like every other route."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.e2e.conftest import MODEL

pytestmark = pytest.mark.e2e
CHAT = [{"role": "user", "content": "Name three uses of an append-only log."}]


async def test_a_chats_token_count_is_what_its_completion_is_billed(base_url: str, caller) -> None:  # type: ignore[no-untyped-def]
    origin = base_url.removesuffix("/v1")
    headers = {"Authorization": f"Bearer {caller.secret}"}
    async with httpx.AsyncClient(timeout=60) as http:
        counted = await http.post(f"{origin}/tokenize", headers=headers, json={"model": MODEL, "messages": CHAT})
        assert counted.status_code == 200, counted.text
        answer = counted.json()
        async with openai.AsyncOpenAI(base_url=base_url, api_key=caller.secret) as client:
            completion = await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)  # type: ignore[arg-type]
        assert completion.usage is not None and completion.usage.prompt_tokens == answer["count"]
        assert answer["max_model_len"] > answer["count"] == len(answer["tokens"])

        text = await http.post(f"{origin}/detokenize", headers=headers, json={"tokens": answer["tokens"]})
        assert text.status_code == 200 and text.json()["prompt"].endswith("<|im_start|>assistant\n")
        assert "Name three uses of an append-only log." in text.json()["prompt"]

        anonymous = await http.post(f"{origin}/tokenize", json={"prompt": "hi"})
        assert anonymous.status_code == 401 and "didn't provide an API key" in anonymous.json()["error"]["message"]
        wrong = await http.post(f"{origin}/detokenize", json={"tokens": [1]}, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
