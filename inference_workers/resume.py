"""Taking over a request that an earlier attempt started: continue from what the client already has.

Two ways, chosen by the request's sampling:

* **continue** (the default): the prompt plus the tokens already emitted becomes the prompt (one prefill), and
  the engine generates only what is missing. At temperature 0 the text equals an uninterrupted run.
* **replay** (a ``seed`` at temperature > 0, presence/frequency penalties, which count only generated tokens,
  stop strings, whose held-back text the engine would never emit for prompt tokens, or a structured output, whose
  grammar starts at the answer's first token and cannot be entered half-way): the engine generates from
  the original prompt again, and the part the client already has is checked token by token and dropped. A seeded
  sample is reproducible, so the text equals an uninterrupted run; if it ever differs, the stream ends in error
  instead of splicing two samples.

Pure logic, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from schemas.events import ChatRequest, SamplingSpec, TokenEvent


@dataclass(frozen=True)
class EmittedPrefix:
    """What earlier attempts of a request emitted, merged exactly as its client's relay merged it."""

    token_ids: list[int]
    text: str
    #: the newest attempt seen (0: nothing was emitted)
    attempt: int = 0
    #: the stream's final event, when an earlier attempt finished it (its transaction may have aborted)
    final: TokenEvent | None = None
    #: the stream already ended in error at its readers
    error: str | None = None

    @property
    def tokens(self) -> int:
        return len(self.token_ids)


NOTHING_EMITTED = EmittedPrefix([], "")


class Diverged(Exception):
    """A replayed generation is not the one the client already has."""


def needs_replay(sampling: SamplingSpec) -> bool:
    """Continuing from the prefix would not give an uninterrupted run's text: a seeded sampler's draws restart,
    penalties on generated tokens would forget the prefix, a stop string held back (the engine withholds the
    text that could begin one) or straddling the failover point would be lost or missed, and a structured output's
    grammar would start over inside the answer. (The gateway gives a structured output at temperature > 0 a seed,
    so that its replay is the same sample.)"""
    return (sampling.temperature > 0 and sampling.seed is not None) or bool(
        sampling.presence_penalty or sampling.frequency_penalty or sampling.stop or sampling.json_schema)


@dataclass(frozen=True)
class Plan:
    """What to ask the engine for."""

    prompt_token_ids: list[int]
    sampling: SamplingSpec
    #: replay only: the tokens (and their text) the engine will generate again and that must be dropped
    replay: EmittedPrefix = NOTHING_EMITTED


def plan(request: ChatRequest, prefix: EmittedPrefix) -> Plan:
    sampling = request.sampling
    if not prefix.tokens:
        return Plan(request.prompt_token_ids, sampling)
    if needs_replay(sampling):
        return Plan(request.prompt_token_ids, sampling, prefix)
    remaining = sampling.max_tokens - prefix.tokens
    return Plan(
        request.prompt_token_ids + prefix.token_ids,
        sampling.model_copy(update={"max_tokens": remaining,
                                    "min_tokens": max(0, sampling.min_tokens - prefix.tokens)}),
    )


class ReplayFilter:
    """Drops the part of a replayed generation that the client already has, checking it is identical."""

    def __init__(self, prefix: EmittedPrefix) -> None:
        self._ids = prefix.token_ids
        self._text = prefix.text
        self._seen_ids = 0
        self._seen_text = ""
        self._text_done = not prefix.text

    @property
    def done(self) -> bool:
        return self._seen_ids >= len(self._ids) and self._text_done

    def feed(self, token_ids: list[int], text: str) -> tuple[list[int], str]:
        """The new part of one engine delta (ids, text). Raises :class:`Diverged`."""
        if self.done:
            return token_ids, text
        overlap = min(len(token_ids), len(self._ids) - self._seen_ids)
        expected = self._ids[self._seen_ids:self._seen_ids + overlap]
        if token_ids[:overlap] != expected:
            raise Diverged(f"the replay produced other tokens at token {self._seen_ids} than the client has")
        self._seen_ids += overlap
        new_ids = token_ids[overlap:]
        if self._text_done:
            return new_ids, text
        # The detokenizer may hold text back (a multi-byte character split across tokens): compare prefixes.
        self._seen_text += text
        if len(self._seen_text) < len(self._text):
            if not self._text.startswith(self._seen_text):
                raise Diverged("the replay produced other text than the client has")
            return new_ids, ""
        if not self._seen_text.startswith(self._text):
            raise Diverged("the replay produced other text than the client has")
        self._text_done = True
        return new_ids, self._seen_text[len(self._text):]
