"""Our chunks and completions parse as the official SDK's types."""

from __future__ import annotations

import orjson
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from producers.gateway.protocol import usage_dict
from producers.relay.sse import DONE, ChunkFormatter, completion


def parse(event: bytes) -> dict:  # type: ignore[type-arg]
    head, _, data = event.partition(b"\n")
    assert head.startswith(b"id: ") and data.startswith(b"data: ") and event.endswith(b"\n\n")
    return orjson.loads(data[6:-2])


def test_stream_chunks_are_valid_chat_completion_chunks() -> None:
    fmt = ChunkFormatter("chatcmpl-x", "m", 1700000000, include_usage=True)
    role = ChatCompletionChunk.model_validate(parse(fmt.role()))
    assert role.choices[0].delta.role == "assistant"
    content = ChatCompletionChunk.model_validate(parse(fmt.content(" Paris", 1)))
    assert content.choices[0].delta.content == " Paris" and content.usage is None
    finish = ChatCompletionChunk.model_validate(parse(fmt.finish("length", 2)))
    assert finish.choices[0].finish_reason == "length"
    usage = ChatCompletionChunk.model_validate(parse(fmt.usage(usage_dict(3, 2, 1), 3)))
    assert usage.choices == [] and usage.usage.total_tokens == 5
    assert usage.usage.prompt_tokens_details.cached_tokens == 1
    assert DONE == b"data: [DONE]\n\n"


def test_chunks_omit_usage_unless_asked() -> None:
    assert "usage" not in parse(ChunkFormatter("i", "m", 1, include_usage=False).content("x", 1))


def test_completion_is_a_valid_chat_completion() -> None:
    body = completion("chatcmpl-x", "m", 1700000000, "Paris.", "stop", usage_dict(37, 3, 0))
    parsed = ChatCompletion.model_validate(body)
    assert parsed.choices[0].message.content == "Paris." and parsed.usage.completion_tokens == 3


def test_a_content_chunk_is_exactly_what_the_dict_would_encode_to() -> None:
    """The content chunk is spliced from prepared bytes: it must stay byte-identical to the plain encoding."""
    for include_usage in (True, False):
        fmt = ChunkFormatter("chatcmpl-q\"uote", 'm "x"', 1700000000, include_usage=include_usage)
        for text, position in ((" Paris", 1), ('"\\\n\t', 22), ("é✓😀 \u2028", 333), ("", 4)):
            assert fmt.content(text, position) == fmt._event({"content": text}, None, position)


def test_without_event_ids_each_event_is_one_data_line_as_openai_sends_it() -> None:
    """What a parser that takes each event for one ``data:`` line (vLLM's benchmark client) reads."""
    with_ids = ChunkFormatter("chatcmpl-x", "m", 1700000000, include_usage=True)
    plain = ChunkFormatter("chatcmpl-x", "m", 1700000000, include_usage=True, event_ids=False)
    events = [(plain.role(), with_ids.role()), (plain.content(" Paris", 1), with_ids.content(" Paris", 1)),
              (plain.finish("stop", 2), with_ids.finish("stop", 2)),
              (plain.usage(usage_dict(3, 2, 1), 3), with_ids.usage(usage_dict(3, 2, 1), 3))]
    for bare, identified in events:
        assert bare.startswith(b"data: ") and bare.endswith(b"\n\n") and bare.count(b"\n") == 2
        assert identified.endswith(bare) and parse(identified) == orjson.loads(bare[6:-2])


def test_a_content_chunk_without_ids_is_exactly_what_the_dict_would_encode_to() -> None:
    for include_usage in (True, False):
        fmt = ChunkFormatter("chatcmpl-q\"uote", 'm "x"', 1700000000, include_usage=include_usage, event_ids=False)
        for text, position in ((" Paris", 1), ('"\\\n\t', 22), ("é✓😀 \u2028", 333), ("", 4)):
            assert fmt.content(text, position) == fmt._event({"content": text}, None, position)
