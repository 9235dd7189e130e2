"""The text a generation adds to a prompt that ends inside a character: what a takeover in *continue* mode needs.

A takeover continues from the tokens its predecessor emitted (``resume.py``): they end the prompt. When they end
inside a character (a byte-level BPE splits most non-Latin characters and emoji over several tokens, and the
detokenizer gives a split character's text with its last token), vLLM's detokenizer goes wrong: primed with the
prompt (``vllm/v1/engine/detokenizer.py``, FastIncrementalDetokenizer), its ``DecodeStream`` finds the text it was
primed with (ending in U+FFFD) no prefix of the next decode, starts over, and streams the whole prompt's text, chat
template and earlier output included, as the continuation's first text. Seen with vLLM 0.32 and tokenizers 0.23.

:class:`ContinuationText` gives that text instead: its stream is primed with the prompt's last whole characters, the
unfinished tail is stepped through (no text of its own), and the first generated token that completes the character
gives it whole. Only for such prompts (``for_prompt``): elsewhere the engine's own text is right.

Owns: the text of one generation's tokens. Must not: import vLLM (the fake engine of the unit tests uses it too).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

#: how many prompt tokens before the unfinished tail prime the stream (the context a byte-level decode needs)
CONTEXT_TOKENS = 8
#: tokens searched back for a character boundary; further back, the engine's text is kept
MAX_TAIL = 16
_REPLACEMENT = "\ufffd"
#: tokenizers' message for a stream whose primed text is not a prefix of the next decode
_INVALID_PREFIX = "Invalid prefix encountered"


def unfinished_tail(tokenizer: Any, prompt_token_ids: Sequence[int]) -> int | None:
    """How many of the prompt's last tokens hold the start of a character it does not finish: 0 for a prompt that
    ends on a whole character; None when no boundary is found within :data:`MAX_TAIL` tokens."""
    window = list(prompt_token_ids[-(MAX_TAIL + CONTEXT_TOKENS):])
    for tail in range(min(MAX_TAIL, len(window)) + 1):
        head = window[:len(window) - tail]
        if not head or not tokenizer.decode(head, skip_special_tokens=True).endswith(_REPLACEMENT):
            return tail
    return None


class ContinuationText:
    """The text each generated token adds to a prompt whose last ``tail`` tokens end inside a character."""

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], tail: int) -> None:
        from tokenizers.decoders import DecodeStream

        self._tokenizer = tokenizer
        self._decode_stream = DecodeStream
        whole = list(prompt_token_ids[:len(prompt_token_ids) - tail])
        self._stream = DecodeStream(ids=whole[-CONTEXT_TOKENS:], skip_special_tokens=True)
        for token in prompt_token_ids[len(prompt_token_ids) - tail:]:
            self._step(token)  # no text: the character is not finished yet

    @classmethod
    def for_prompt(cls, tokenizer: Any, prompt_token_ids: Sequence[int]) -> ContinuationText | None:
        """The text to use instead of the engine's for a prompt ending inside a character; None for any other."""
        tail = unfinished_tail(tokenizer, prompt_token_ids)
        return cls(tokenizer, prompt_token_ids, tail) if tail else None

    def text(self, token_ids: Sequence[int]) -> str:
        return "".join(self._step(token) for token in token_ids)

    def _step(self, token: int) -> str:
        try:
            return self._stream.step(self._tokenizer, token) or ""
        except Exception as exc:  # as vLLM recovers (a non-monotonic decode): start a fresh stream
            if not str(exc).startswith(_INVALID_PREFIX):
                raise
            self._stream = self._decode_stream(skip_special_tokens=True)
            return self._stream.step(self._tokenizer, token) or ""
