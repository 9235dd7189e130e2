"""The pre-filter's verdict on whole requests: every window of a request's prompt (``policy.prompt_windows``)
classified, in one forward pass per bar for a batch of requests, with a bounded memory of the windows already
judged.

The memory is what keeps whole-prompt screening cheap where prompts repeat themselves: a chat client sends the
whole history again with every turn, a conversation's turn carries its history, an application sends the same
system prompt with every request; only the new text is classified. The classifier is deterministic, so a remembered
verdict is the verdict. Must not: produce, consume or decide what a verdict leads to (``processor.py`` does).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import OrderedDict

from runtime.metrics import SAFETY_CLASSIFY, SAFETY_VERDICTS
from schemas.events import ChatRequest
from stream_processors.safety.classifier import SafetyClassifier, Verdict
from stream_processors.safety.policy import PromptWindows, prompt_windows

#: windows remembered (a 17-byte key and a verdict each, about 250 bytes: 12 MB when full)
REMEMBERED = 50_000

_Key = bytes


async def classify_many(classifier: SafetyClassifier, texts: list[str], stage: str, *,
                        context: bool = False) -> list[Verdict]:
    """One forward pass for a batch: under load this is most of the pre-filter's cost, and a batch of n costs
    far less than n single passes."""
    started = time.perf_counter()
    verdicts = await asyncio.to_thread(classifier.classify, texts, context=context)
    SAFETY_CLASSIFY.labels(stage=stage).observe(time.perf_counter() - started)
    return verdicts


def counted(stage: str, verdicts: list[Verdict]) -> list[Verdict]:
    for verdict in verdicts:
        SAFETY_VERDICTS.labels(stage=stage, blocked=str(verdict.blocked).lower(), category=verdict.category).inc()
    return verdicts


class PromptScreen:
    def __init__(self, classifier: SafetyClassifier, *, remembered: int = REMEMBERED) -> None:
        self._classifier = classifier
        self._known: OrderedDict[_Key, Verdict] = OrderedDict()
        self._capacity = remembered

    async def verdicts(self, requests: list[ChatRequest]) -> list[Verdict]:
        """Each request's verdict: blocked when any of its windows is (the most certain of those), else the
        newest user turn's."""
        plans = [prompt_windows(request) for request in requests]
        found: dict[_Key, Verdict] = {}
        for context in (False, True):
            asked = []
            for text in dict.fromkeys(t for plan in plans for t in (plan.context if context else (plan.primary,))):
                key = _key(context, text)
                known = self._known.get(key)
                if known is None:
                    asked.append(text)
                else:
                    found[key] = known
                    self._known.move_to_end(key)
            if asked:
                judged = await classify_many(self._classifier, asked, "pre", context=context)
                for text, verdict in zip(asked, judged, strict=True):
                    found[_key(context, text)] = verdict
                    self._remember(_key(context, text), verdict)
        return counted("pre", [_fold(plan, found) for plan in plans])

    def _remember(self, key: _Key, verdict: Verdict) -> None:
        self._known[key] = verdict
        while len(self._known) > self._capacity:
            self._known.popitem(last=False)


def _fold(plan: PromptWindows, found: dict[_Key, Verdict]) -> Verdict:
    primary = found[_key(False, plan.primary)]
    blocked = [v for v in (primary, *(found[_key(True, t)] for t in plan.context)) if v.blocked]
    return max(blocked, key=lambda v: v.score) if blocked else primary


def _key(context: bool, text: str) -> _Key:
    return (b"c" if context else b"p") + hashlib.blake2b(text.encode(), digest_size=16).digest()
