"""The sampling parameters reach the engine and change what it generates: ``min_tokens`` keeps an answer going past
a stop that would end it sooner, ``top_k: 1`` and a tiny ``top_p`` turn a hot seeded sample into the greedy answer,
and the repetition, presence and frequency penalties stop an answer repeating itself. (``temperature``, ``seed``,
``max_tokens``, ``stop`` and ``ignore_eos``: tests/e2e/test_chat.py.)"""

from __future__ import annotations

from collections import Counter
from typing import Any

import openai
import pytest

from tests.e2e.conftest import MODEL, QUESTION

pytestmark = pytest.mark.e2e

#: SmolLM2 answers it greedily by saying one phrase twice ("... a vast and mysterious realm ...")
REPETITIVE = [{"role": "user", "content": "Describe the ocean."}]
SEEDS = (1, 2, 3)


def ask(client: openai.OpenAI, messages: list[dict[str, str]] = QUESTION, **sampling: Any) -> tuple[str, int, str]:
    """(text, completion tokens, finish reason); vLLM's own parameters go in the body as they are."""
    openai_params = {k: sampling.pop(k) for k in ("max_tokens", "temperature", "top_p", "seed", "stop",
                                                 "presence_penalty", "frequency_penalty") if k in sampling}
    answer = client.chat.completions.create(model=MODEL, messages=messages, extra_body=sampling,  # type: ignore[arg-type]
                                            **openai_params)
    choice = answer.choices[0]
    return choice.message.content or "", answer.usage.completion_tokens, choice.finish_reason  # type: ignore[union-attr]


def repeated_phrases(text: str, words: int = 4) -> int:
    """How many runs of ``words`` words occur more than once."""
    tokens = text.lower().replace(",", " ").replace(".", " ").split()
    runs = Counter(tuple(tokens[i:i + words]) for i in range(len(tokens) - words + 1))
    return sum(1 for count in runs.values() if count > 1)


def test_min_tokens_keeps_an_answer_going_past_a_stop_that_would_end_it_sooner(client: openai.OpenAI) -> None:
    short, short_tokens, short_finish = ask(client, max_tokens=32, temperature=0, stop=["."])
    assert short_finish == "stop" and short_tokens < 12, (short, short_tokens)
    longer, tokens, _ = ask(client, max_tokens=32, temperature=0, stop=["."], min_tokens=16)
    assert tokens >= 16, (longer, tokens)
    assert longer.startswith(short) and len(longer) > len(short)


def test_top_k_one_and_a_tiny_top_p_turn_a_hot_sample_into_the_greedy_answer(client: openai.OpenAI) -> None:
    greedy = ask(client, max_tokens=12, temperature=0)[0]
    hot = [ask(client, max_tokens=12, temperature=1.5, seed=seed)[0] for seed in SEEDS]
    assert any(text != greedy for text in hot), "the hot samples are all the greedy answer: nothing to narrow"
    for seed in SEEDS:
        assert ask(client, max_tokens=12, temperature=1.5, seed=seed, top_k=1)[0] == greedy, f"top_k=1, seed {seed}"
        assert ask(client, max_tokens=12, temperature=1.5, seed=seed, top_p=0.01)[0] == greedy, f"top_p, seed {seed}"


@pytest.mark.parametrize("penalty", [{"repetition_penalty": 1.5}, {"presence_penalty": 2.0},
                                     {"frequency_penalty": 2.0}], ids=lambda p: next(iter(p)))
def test_a_penalty_stops_an_answer_repeating_itself(client: openai.OpenAI, penalty: dict[str, float]) -> None:
    plain = ask(client, REPETITIVE, max_tokens=32, temperature=0)[0]
    assert repeated_phrases(plain) > 0, f"the greedy answer no longer repeats itself: {plain!r}"
    penalized = ask(client, REPETITIVE, max_tokens=32, temperature=0, **penalty)[0]
    assert penalized != plain and repeated_phrases(penalized) < repeated_phrases(plain), (plain, penalized)
