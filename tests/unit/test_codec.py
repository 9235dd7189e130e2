"""Avro single-object encoding: header, fingerprint (per the Avro spec), errors."""

from __future__ import annotations

import json

import pytest
from fastavro.schema import to_parsing_canonical_form

from schemas.codec import MAGIC, codec_for, schema_versions
from schemas.errors import DecodeError
from schemas.events import TokenEvent

EVENT = TokenEvent(request_id="r1", attempt=1, seq=0, token_offset=0, token_ids=[42], text="hi", worker_id="w",
                   emitted_at_us=5)


def crc64_avro(data: bytes) -> int:
    """The Avro spec's reference algorithm (EMPTY = 0xc15d213aa4d7a795)."""
    empty = 0xC15D213AA4D7A795
    table = []
    for i in range(256):
        fp = i
        for _ in range(8):
            fp = (fp >> 1) ^ (empty & -(fp & 1))
        table.append(fp)
    fp = empty
    for byte in data:
        fp = (fp >> 8) ^ table[(fp ^ byte) & 0xFF]
    return fp


def test_record_starts_with_magic_and_little_endian_fingerprint_of_the_canonical_schema() -> None:
    data = codec_for(TokenEvent).encode(EVENT)
    newest = schema_versions("token_event")[-1]
    canonical = to_parsing_canonical_form(newest.raw).encode()
    assert data[:2] == MAGIC
    assert data[2:10] == crc64_avro(canonical).to_bytes(8, "little")


def test_spec_vector_for_int() -> None:
    # The Avro specification's example: the CRC-64-AVRO fingerprint of "int".
    assert crc64_avro(b'"int"') == 0x7275D51A3F395C8F


def test_unknown_fingerprint_is_a_decode_error() -> None:
    data = bytearray(codec_for(TokenEvent).encode(EVENT))
    data[5] ^= 0xFF
    with pytest.raises(DecodeError, match="unknown schema fingerprint"):
        codec_for(TokenEvent).decode(bytes(data))


@pytest.mark.parametrize("data", [b"", b"\x00\x01", json.dumps({"a": 1}).encode(), b"\xc3\x01" + b"\x00" * 4])
def test_garbage_is_a_decode_error(data: bytes) -> None:
    with pytest.raises(DecodeError):
        codec_for(TokenEvent).decode(data)


def test_truncated_body_is_a_decode_error() -> None:
    data = codec_for(TokenEvent).encode(EVENT)
    with pytest.raises(DecodeError):
        codec_for(TokenEvent).decode(data[:14])
