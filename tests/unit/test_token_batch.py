"""TokenEvent v3: one record carries one engine step's deltas of many requests, each with its own seq; older
readers and writers keep working through the documented upgrade path (``schemas/token_batch.py``)."""

from __future__ import annotations

from typing import get_type_hints

import pytest

from schemas.codec import EventCodec, codec_for, schema_versions
from schemas.errors import DecodeError
from schemas.events import TokenEvent
from schemas.token_batch import DELTA_FIELDS, SHARED, Delta, events, may_carry, pack
from schemas.token_stream import TokenStream
from tests.helpers import token_event


def _step(seq: int, *request_ids: str) -> list[TokenEvent]:
    """One engine step's deltas (a record's deltas share its worker and emission time)."""
    return [token_event(rid, seq, f"{rid}:{seq} ").model_copy(update={"emitted_at_us": 1_800_000_000_000_000 + seq})
            for rid in request_ids]


def test_a_packed_record_round_trips_to_the_same_events_in_order() -> None:
    codec = codec_for(TokenEvent)
    step = _step(3, "req-a", "req-b", "req-c")
    decoded = codec.decode_dict(codec.encode_dict(pack(step)))
    back = list(events(decoded))
    assert all(isinstance(each, Delta) for each in back)  # deltas are not validated again (the relay's hot path)
    assert [each.event() for each in back if isinstance(each, Delta)] == step
    assert codec.decode(codec.encode_dict(pack(step))).split() == step  # the model's own split agrees


def test_a_final_is_read_as_a_validated_event() -> None:
    codec = codec_for(TokenEvent)
    final = token_event("req-a", 4, "", final=True)
    (back,) = events(codec.decode_dict(codec.encode(final)))
    assert isinstance(back, TokenEvent)
    assert back == final


def test_a_delta_has_the_fields_of_a_packed_delta_then_those_its_record_shares() -> None:
    """``Delta`` is written out as a NamedTuple for the worker's hot path; it must follow the schema's models."""
    assert Delta._fields == (*DELTA_FIELDS, *SHARED)
    assert set(Delta._fields) <= set(TokenEvent.model_fields)
    hints = get_type_hints(Delta)
    assert all(hints[name] == TokenEvent.model_fields[name].annotation for name in Delta._fields)


def _as_delta(event: TokenEvent) -> Delta:
    return Delta(event.request_id, event.attempt, event.seq, event.token_offset, event.token_ids, event.text,
                 event.worker_id, event.emitted_at_us)


@pytest.mark.parametrize("version", [2, 3])
def test_a_worker_s_deltas_make_the_very_bytes_of_their_events(version: int) -> None:
    """The worker emits model-free deltas (its hot path); readers must get exactly the events a model would make."""
    codec = codec_for(TokenEvent)
    events = _step(7, "req-a", "req-b", "req-c")[: 1 if version == 2 else None]
    deltas = [_as_delta(e) for e in events]
    assert codec.encode_dict(pack(deltas), version=version) == codec.encode_dict(pack(events), version=version)
    assert [codec.decode(codec.encode_dict(pack([d]), version=version)) for d in deltas] == \
        [d.event() for d in deltas] == events[: len(deltas)]
    # mixed: a record opened by one kind carries the other
    assert codec.encode_dict(pack([deltas[0], *events[1:]])) == codec.encode_dict(pack(events))


def test_one_event_packs_into_a_plain_record() -> None:
    codec = codec_for(TokenEvent)
    event = token_event("solo", 0)
    assert codec.decode(codec.encode_dict(pack([event]))) == event
    assert codec.decode(codec.encode_dict(pack([event]))).split() == [event]


def test_a_final_is_never_packed_behind_others() -> None:
    with pytest.raises(ValueError, match="final"):
        pack([token_event("a", 0), token_event("b", 4, final=True)])
    with pytest.raises(ValueError):
        pack([])


def test_the_merge_of_packed_records_equals_the_merge_of_one_record_per_delta() -> None:
    """What resume positions and failover rely on: per-request seq survives packing."""
    codec = codec_for(TokenEvent)
    steps = [_step(seq, "req-a", "req-b") for seq in range(5)]
    packed = [e for step in steps for e in codec.decode(codec.encode_dict(pack(step))).split()]
    single = [e for step in steps for e in step]
    for rid in ("req-a", "req-b"):
        merged = []
        for read in (packed, single):
            stream, text = TokenStream(rid), ""
            for event in read:
                if event.request_id == rid and (accepted := stream.put(event)) is not None:
                    text += accepted.text
            merged.append((text, list(stream.token_ids), stream.error))
        assert merged[0] == merged[1] and merged[0][2] is None


def test_a_v3_reader_reads_v2_records() -> None:
    codec = codec_for(TokenEvent)
    event = token_event("old-writer", 2)
    v2_bytes = codec.encode_dict(event.model_dump(), version=2)
    assert v2_bytes[2:10] == schema_versions("token_event")[1].fingerprint
    assert codec.decode(v2_bytes) == event


def test_a_v2_reader_reads_what_a_worker_writes_in_upgrade_mode_and_refuses_v3() -> None:
    """The upgrade path: a worker with token_record_version=2 writes one request per record in v2; a reader that
    only knows v1/v2 reads it. A v3 record is refused by that reader (so readers are upgraded first)."""
    codec = codec_for(TokenEvent)
    old_reader = EventCodec(TokenEvent)
    old_reader.latest = schema_versions("token_event")[1]
    old_reader._by_fingerprint = {v.fingerprint: v for v in schema_versions("token_event")[:2]}  # type: ignore[misc]
    event = token_event("rolling", 1)
    fields = old_reader.decode_dict(codec.encode_dict(pack([event]), version=2))
    assert TokenEvent.model_validate(fields) == event
    with pytest.raises(DecodeError, match="unknown schema fingerprint"):
        old_reader.decode_dict(codec.encode_dict(pack(_step(0, "a", "b"))))


def test_unknown_writer_version_is_refused() -> None:
    with pytest.raises(ValueError, match="no schema version 9"):
        codec_for(TokenEvent).encode_dict(token_event("x", 0).model_dump(), version=9)


@pytest.mark.parametrize("request_ids", [
    ("chatcmpl-aaa",),
    ("chatcmpl-aaa", "chatcmpl-bbb"),
    ("r", "r1", "r12", "r123"),  # each a prefix of the next
    ("chatcmpl-1", "xchatcmpl-1", "chatcmpl-10"),  # inside and around one another
    ("résumé-é", "请求-一", "emoji-\U0001f600", "plain"),  # multi-byte UTF-8
    tuple(f"chatcmpl-{i}" for i in range(40)),  # a full engine step
])
def test_may_carry_never_misses_a_request_of_the_record(request_ids: tuple[str, ...]) -> None:
    """No false negative whatever the ids (a false positive only costs a decode): ids that are prefixes of one
    another, multi-byte text, many per record; and an id the record does not hold is told apart."""
    value = codec_for(TokenEvent).encode_dict(pack(_step(0, *request_ids)))
    assert [rid for rid in request_ids if not may_carry(value, rid.encode())] == []
    assert not may_carry(value, b"chatcmpl-ccc")
