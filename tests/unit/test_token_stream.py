"""The one merge of a request's token events (relay and takeover alike): never a text no generation produced.

Defect 4 of the correctness issue: the old collector de-duplicated by token count and appended an event's whole
text when only part of it was new, so a failover at temperature > 0 spliced two samples ("The", " cat", " sat"
then "The cat", " sat on", " the mat" gave "The cat sat sat on the mat"), and a new attempt that ended before
the client's position ended the stream on the old text with the new attempt's usage.
"""

from __future__ import annotations

from schemas.events import TokenEvent, TokenUsage
from schemas.token_stream import TokenStream

WORDS = {"The": 1, " cat": 2, " sat": 3, " on": 4, " the": 5, " mat": 6, " dog": 7, "The cat": 0}


def ev(attempt: int, seq: int, offset: int, ids: list[int], text: str, final: str | None = None,
       completion: int = 0) -> TokenEvent:
    return TokenEvent(request_id="r", attempt=attempt, seq=seq, token_offset=offset, token_ids=ids, text=text,
                      finish_reason=final, usage=TokenUsage(prompt_tokens=5, completion_tokens=completion)
                      if final else None, worker_id="w", emitted_at_us=0)


def text_of(stream: TokenStream, events: list[TokenEvent]) -> str:
    out = ""
    for event in events:
        accepted = stream.put(event)
        if accepted is not None:
            out += accepted.text
    return out


def test_the_reviewed_splice_ends_in_an_error_instead_of_duplicated_text() -> None:
    stream = TokenStream("r")
    text = text_of(stream, [
        ev(1, 0, 0, [1], "The"), ev(1, 1, 1, [2], " cat"), ev(1, 2, 2, [3], " sat"),
        # attempt 2 starts over, with events that hold several tokens: its second event straddles the client's
        # position, so its text cannot be split into "what the client has" and "what is new"
        ev(2, 0, 0, [1, 2], "The cat"), ev(2, 1, 2, [3, 4], " sat on"), ev(2, 2, 4, [5, 6], " the mat"),
    ])
    assert text == "The cat sat"  # never "The cat sat sat on the mat"
    assert stream.error is not None and "mid-event" in stream.error
    assert stream.error_code == "stream_inconsistent"


def test_a_new_attempt_that_diverges_from_what_the_client_has_is_an_error() -> None:
    stream = TokenStream("r")
    text = text_of(stream, [ev(1, 0, 0, [1], "The"), ev(1, 1, 1, [2], " cat"),
                            ev(2, 0, 0, [1], "The"), ev(2, 1, 1, [7], " dog"), ev(2, 2, 2, [3], " sat")])
    assert text == "The cat"
    assert stream.error is not None and "diverged" in stream.error and "token 1" in stream.error


def test_a_new_attempt_that_finishes_before_the_clients_position_is_an_error_not_its_usage() -> None:
    stream = TokenStream("r")
    text_of(stream, [ev(1, 0, 0, [1], "The"), ev(1, 1, 1, [2], " cat"), ev(1, 2, 2, [3], " sat")])
    stream.put(ev(2, 0, 0, [1], "The", final="stop", completion=1))
    assert stream.final is None
    assert stream.error is not None and "before the 3 tokens" in stream.error


def test_an_identical_replay_is_dropped_and_the_continuation_appended() -> None:
    stream = TokenStream("r")
    text = text_of(stream, [ev(1, 0, 0, [1], "The"), ev(1, 1, 1, [2], " cat"),
                            ev(2, 0, 0, [1], "The"), ev(2, 1, 1, [2], " cat"), ev(2, 2, 2, [3], " sat"),
                            ev(2, 3, 3, [], "", final="stop", completion=3)])
    assert text == "The cat sat" and stream.error is None
    assert stream.final is not None and stream.final.usage is not None and stream.final.usage.completion_tokens == 3


def test_a_continuation_from_the_emitted_prefix_is_seamless_and_the_old_attempt_goes_stale() -> None:
    stream = TokenStream("r")
    text = text_of(stream, [ev(1, 0, 0, [1], "The"), ev(1, 1, 1, [2], " cat"),
                            ev(2, 0, 2, [3], " sat"), ev(1, 2, 2, [7], " dog"),  # the old attempt, late
                            ev(2, 1, 3, [4], " on", final="length", completion=4)])
    assert text == "The cat sat on" and stream.error is None
    assert list(stream.token_ids) == [1, 2, 3, 4]


def test_a_lost_event_is_an_error_not_a_silent_gap() -> None:
    by_seq = TokenStream("r")
    assert text_of(by_seq, [ev(1, 0, 0, [1], "The"), ev(1, 2, 2, [3], " sat")]) == "The"
    assert by_seq.error is not None and "missing" in by_seq.error
    by_offset = TokenStream("r")
    assert text_of(by_offset, [ev(1, 0, 0, [1], "The"), ev(2, 0, 3, [4], " on")]) == "The"
    assert by_offset.error is not None and "never arrived" in by_offset.error


def test_duplicates_are_ignored_and_nothing_counts_after_the_end() -> None:
    stream = TokenStream("r")
    assert text_of(stream, [ev(1, 0, 0, [1], "The"), ev(1, 0, 0, [1], "The"),
                            ev(1, 1, 1, [2], " cat", final="stop", completion=2), ev(1, 2, 2, [3], " sat")]) \
        == "The cat"
    assert stream.duplicates == 2 and stream.final is not None
