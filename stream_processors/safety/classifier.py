"""Safety classifiers: one Protocol, one class per mechanism, a registry and a factory.

* ``rules``: regular expressions for the obvious (``data/rules.v1.json``); no false friends like "kill a process".
* ``embedding``: nearest-exemplar scoring over a curated, labelled, versioned set (``data/exemplars.v1.jsonl``)
  with all-MiniLM-L6-v2 embeddings: a text is harmful when its closest harmful exemplar is similar enough *and*
  clearly closer than its closest benign one (the benign set holds the hard negatives).
* ``combined`` (the default): rules first, then embeddings.

``classify`` is blocking CPU work (a batch of texts at a time); processors call it in a thread. ``context=True``
judges text that surrounds the request rather than being it (system prompts, earlier turns, windows of a long
message: ``policy.prompt_windows``): the rules alike, the embeddings at a stricter bar, because a request has many
such windows and each one is another chance of a false alarm.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from runtime.settings import SafetySettings

DATA = Path(__file__).parent / "data"
EXEMPLARS = DATA / "exemplars.v2.jsonl"
RULES = DATA / "rules.v1.json"
BENIGN = "benign"
#: texts embedded in one forward pass
EMBED_SLICE = 32


@dataclass(frozen=True)
class Verdict:
    blocked: bool
    category: str
    score: float
    #: what decided: "rule:<category>", "nearest:<exemplar text>" or "none"
    reason: str


ALLOW = Verdict(False, BENIGN, 0.0, "none")


class SafetyClassifier(Protocol):
    #: name and data version, recorded in every verdict
    name: str

    def classify(self, texts: list[str], *, context: bool = False) -> list[Verdict]: ...


def load_labelled(path: Path) -> list[dict[str, str]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class RuleClassifier:
    def __init__(self, path: Path = RULES) -> None:
        data = json.loads(path.read_text())
        self.name = f"rules/{data['version']}"
        self._rules = [(r["category"], re.compile(r["pattern"], re.IGNORECASE)) for r in data["rules"]]

    def one(self, text: str) -> Verdict:
        for category, pattern in self._rules:
            if pattern.search(text):
                return Verdict(True, category, 1.0, f"rule:{category}")
        return ALLOW

    def classify(self, texts: list[str], *, context: bool = False) -> list[Verdict]:
        return [self.one(t) for t in texts]


class EmbeddingClassifier:
    def __init__(self, settings: SafetySettings, path: Path = EXEMPLARS, embedder: Any = None) -> None:
        from stream_processors.safety.embedder import Embedder

        self.name = f"embedding/{path.stem}"
        self._embedder = embedder or Embedder(threads=settings.embedding_threads)
        rows = load_labelled(path)
        self._texts = [r["text"] for r in rows]
        self._categories = [r["category"] for r in rows]
        self._harmful = [r["label"] != BENIGN for r in rows]
        self._matrix = self._embedder.embed(self._texts)
        self._bars = {False: (settings.embedding_threshold, settings.embedding_margin),
                      True: (settings.embedding_context_threshold, settings.embedding_context_margin)}
        self._k = settings.embedding_neighbours

    def scores(self, texts: list[str]) -> list[tuple[float, float, int]]:
        """Per text: (best harmful similarity, best benign similarity, index of the best harmful exemplar),
        each a mean over the k nearest of its class (k=1 is plain nearest neighbour)."""
        torch = self._embedder._torch
        # Shortest first, a slice at a time: a batch is padded to its longest text, and the windows of one long
        # prompt are many short texts beside a few long ones.
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        embedded = [self._embedder.embed([texts[i] for i in order[start:start + EMBED_SLICE]])
                    for start in range(0, len(order), EMBED_SLICE)]
        sims = torch.cat(embedded) @ self._matrix.T if embedded else []
        harmful_mask = torch.tensor(self._harmful)
        out: list[tuple[float, float, int]] = [(0.0, 0.0, 0)] * len(texts)
        for i, row in zip(order, sims, strict=True):
            harmful, benign = row[harmful_mask], row[~harmful_mask]
            k_h, k_b = min(self._k, len(harmful)), min(self._k, len(benign))
            top_h = harmful.topk(k_h)
            best_index = int(harmful_mask.nonzero()[top_h.indices[0]])
            out[i] = (float(top_h.values.mean()), float(benign.topk(k_b).values.mean()), best_index)
        return out

    def classify(self, texts: list[str], *, context: bool = False) -> list[Verdict]:
        threshold, margin = self._bars[context]
        verdicts = []
        for harmful, benign, index in self.scores(texts):
            blocked = harmful >= threshold and harmful - benign >= margin
            category = self._categories[index] if blocked else BENIGN
            verdicts.append(Verdict(blocked, category, round(harmful, 4), f"nearest:{self._texts[index]}"))
        return verdicts


class CombinedClassifier:
    def __init__(self, settings: SafetySettings) -> None:
        self._rules = RuleClassifier()
        self._embedding = EmbeddingClassifier(settings)
        self.name = f"combined/{RULES.stem}+{EXEMPLARS.stem}"

    def classify(self, texts: list[str], *, context: bool = False) -> list[Verdict]:
        verdicts = self._rules.classify(texts)
        undecided = [i for i, v in enumerate(verdicts) if not v.blocked]
        if undecided:
            for i, verdict in zip(undecided, self._embedding.classify([texts[i] for i in undecided], context=context),
                                  strict=True):
                verdicts[i] = verdict
        return verdicts


CLASSIFIERS: dict[str, Callable[[SafetySettings], SafetyClassifier]] = {
    "rules": lambda _settings: RuleClassifier(),
    "embedding": EmbeddingClassifier,
    "combined": CombinedClassifier,
}


def make_classifier(settings: SafetySettings, name: str | None = None) -> SafetyClassifier:
    chosen = name or settings.classifier
    if chosen not in CLASSIFIERS:
        raise ValueError(f"unknown safety classifier {chosen!r}; one of {', '.join(CLASSIFIERS)}")
    return CLASSIFIERS[chosen](settings)
