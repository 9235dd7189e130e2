"""Review of 8acffb3 (helper): the relay's deltas as ``token_batch.Delta``, not validated ``TokenEvent``s, counted
once per record. The first tests hold what the change claims; the last one is a defect older than it (failing on
8acffb3^ too, fixed in ``TokenStream``): a record that decodes with an ``int`` out of the schema's range crashed
the partition's whole feed."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from producers.relay.demux import Relay
from runtime.settings import Settings
from schemas.codec import codec_for
from schemas.events import ErrorCode, TokenEvent
from schemas.token_batch import Delta, events, pack

CODEC = codec_for(TokenEvent)


def _delta(rid: str, seq: int, ids: list[int], text: str, *, attempt: int = 0, offset: int | None = None) -> Delta:
    return Delta(rid, attempt, seq, seq if offset is None else offset, ids, text, "w1", 1_800_000_000_000_000 + seq)


def _record(offset: int, value: bytes, key: bytes | None = None) -> Any:
    return SimpleNamespace(offset=offset, key=key, value=value)


def _value(counter: Any) -> float:
    return float(counter._value.get())


@pytest.mark.parametrize("version", [1, 2, 3])
def test_events_agree_with_the_models_split_for_every_record_version(version: int) -> None:
    """A non-final top level carrying usage/error (never written: dropped by the Delta, ignored by the merge before)."""
    fields = {**_delta("req-a", 2, [7, 8], "é🙂")._asdict(), "finish_reason": None, "error": "x", "error_code": "y",
              "usage": {"prompt_tokens": 1, "completion_tokens": 2, "cached_tokens": 0}, "more": []}
    decoded = CODEC.decode_dict(CODEC.encode_dict(fields, version=version))
    (back,) = events(decoded)
    assert isinstance(back, Delta)
    (model,) = CODEC.decode(CODEC.encode_dict(fields, version=version)).split()
    assert back.event() == model.model_copy(update={"usage": None, "error": None, "error_code": None})
    assert [type(v) for v in back] == [str, int, int, int, list, str, str, int]


def test_counters_still_count_each_delta_of_a_packed_record() -> None:
    async def run() -> tuple[float, float, float]:
        relay = Relay(Settings().kafka, "t", 0)
        before = _value(relay.routed), _value(relay.duplicate), _value(relay.unknown)
        relay.register("req-a")
        relay.register("req-b")
        step = [_delta("req-a", 0, [1], "a"), _delta("req-b", 0, [2], "b"), _delta("req-a", 1, [3], "c"),
                _delta("req-zz", 0, [4], "d"), _delta("req-b", 0, [2], "b")]  # an unknown id; req-b's again
        await relay._own._route(_record(0, CODEC.encode_dict(pack(step))))
        after = _value(relay.routed), _value(relay.duplicate), _value(relay.unknown)
        return after[0] - before[0], after[1] - before[1], after[2] - before[2]

    assert asyncio.run(run()) == (3, 1, 1)


def test_an_int_out_of_the_schemas_range_ends_its_stream_not_the_whole_feed() -> None:
    """Avro ``int`` is 32-bit, but fastavro neither refuses a larger value
    on write nor on read (a buggy writer or a corrupt body decodes to any int), and neither the model (before) nor
    the Delta (now) bounds it. ``TokenStream`` keeps ids in ``array('i')``: ``extend`` raises OverflowError out of
    ``_Feed._route``, so ``_run`` fails every open stream of the partition (GATEWAY_STOPPING) and the feed dies,
    where an unreadable record is meant to be dead-lettered and end only the streams it carries."""

    async def run() -> None:
        relay = Relay(Settings().kafka, "t", 0)
        bad, good = relay.register("req-a"), relay.register("req-b")
        value = CODEC.encode_dict(pack([_delta("req-a", 0, [2**40], "x"), _delta("req-b", 0, [5], "y")]))
        assert CODEC.decode_dict(value)["token_ids"] == [2**40]  # decodes without a DecodeError
        await relay._own._route(_record(0, value))  # raised OverflowError: every stream of the feed ended
        assert good.stream.tokens == 1 and not good.finished  # the other request's delta still reaches its stream
        assert bad.finished and bad.stream.error_code == ErrorCode.UNDECODABLE_EVENT
        assert bad.stream.tokens == 0

    asyncio.run(run())


def test_a_feed_of_a_few_streams_decodes_only_the_records_that_carry_one_of_them() -> None:
    """A far resume's catch-up reads thousands of other requests' records for its one stream: it looks for its
    stream's id among a record's bytes first, and decodes only the records that may carry it."""

    class Counting:
        decoded = 0

        def decode_dict(self, value: bytes) -> dict[str, Any]:
            Counting.decoded += 1
            return CODEC.decode_dict(value)

    async def run() -> tuple[int, int, float]:
        relay = Relay(Settings().kafka, "t", 0)
        relay._own._codec = Counting()  # type: ignore[assignment]
        before = _value(relay.unknown)
        ours = relay.register("req-ours")
        others = [CODEC.encode_dict(pack([_delta(f"req-{n:04d}", 0, [n], "x"),
                                          _delta(f"req-{n + 1:04d}", 0, [1], "y")])) for n in range(100)]
        for offset, value in enumerate(others):
            await relay._own._route(_record(offset, value))
        mixed = CODEC.encode_dict(pack([_delta("req-0007", 1, [2], "z"), _delta("req-ours", 0, [9], "o")]))
        await relay._own._route(_record(100, mixed))
        return Counting.decoded, ours.stream.tokens, _value(relay.unknown) - before

    decoded, tokens, unknown = asyncio.run(run())
    assert (decoded, tokens) == (1, 1)
    assert unknown == 100 + 1  # the records not decoded, and the other request's delta of the decoded one
