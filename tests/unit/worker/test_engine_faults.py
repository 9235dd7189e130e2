"""What the client and the bill show when the engine's output is not one ASCII token per delta: text through the
served model's real tokenizer and vLLM's detokenizer (characters split over several tokens, several tokens per delta)
across a takeover, and a generation that fails mid-stream (the real Intake, OffsetTracker and rebalance listener over
the fakes)."""

from __future__ import annotations

import pytest
from aiokafka import TopicPartition

from inference_workers.intake import ENGINE_FAILED
from inference_workers.protocol import EngineDeadError
from inference_workers.synthetic import expected_completion
from schemas.events import ErrorCode
from tests.fakes.engine import FakeEngine, model_tokenizer
from tests.fakes.kafka import FakeGroup
from tests.fakes.worker import TOPIC, make, request, until

P0 = TopicPartition(TOPIC, 0)
#: accents, a euro sign, emoji (one with a skin tone), Japanese and Greek: most characters span several tokens
ANSWER = "Ce café coûte 3€ 🙂 日本語です. 👍🏽 Ελληνικά!"
PROMPT = "<|im_start|>user\nSay it in many scripts<|im_end|>\n<|im_start|>assistant\n"


def _encode(text: str) -> list[int]:
    return list(model_tokenizer().encode(text, add_special_tokens=False).ids)


def _boundaries() -> list[int]:
    return list(range(1, len(_encode(ANSWER))))


@pytest.mark.parametrize("tokens_per_delta", [1, 3])
@pytest.mark.parametrize("emitted", _boundaries())
async def test_a_takeover_anywhere_in_the_answer_gives_the_client_the_uninterrupted_text(
        emitted: int, tokens_per_delta: int) -> None:
    """The takeover continues from the tokens the first worker emitted (``resume.py``, continue mode): wherever they
    end, inside a character too, the client's text is the answer's, and it is billed once."""
    tokenizer, prompt, answer = model_tokenizer(), _encode(PROMPT), _encode(ANSWER)

    def engine(**kwargs: object) -> FakeEngine:
        return FakeEngine(tokenizer=tokenizer, answer=answer, tokens_per_delta=tokens_per_delta, **kwargs)  # type: ignore[arg-type]

    group = FakeGroup()
    w1, w2 = make("w1", group, engine(auto=False)), make("w2", group, engine())
    await w1.assign(0)
    req = request(max_tokens=64, prompt=prompt)
    await w1.handle(req, 0, 0)
    w1.engine.step(req.request_id, emitted)
    delivered = emitted - emitted % tokens_per_delta  # a delta goes out once it has its tokens
    await until(lambda: sum(len(g.emitted) for g in w1.engine.generations) == emitted
                and len(group.log.client_view(req.request_id)[1].token_ids) == delivered)
    assert list(group.log.client_view(req.request_id)[1].token_ids) == answer[:delivered]
    await w1.assign()  # the partition moves: the next owner continues from what the client has
    await w2.assign(0)
    await w2.handle(req, 0, 0)
    await w2.settle()

    text, stream = group.log.client_view(req.request_id)
    assert stream.error is None and stream.final is not None and stream.final.finish_reason == "stop"
    assert text == ANSWER, f"after {delivered} tokens: {text!r}"
    (usage,) = group.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt), len(answer))


@pytest.mark.parametrize("tokens_per_delta", [1, 2])
async def test_a_generation_that_fails_mid_stream_ends_the_clients_stream_in_error_billed_for_what_it_received(
        tokens_per_delta: int) -> None:
    group = FakeGroup()
    engine = FakeEngine(tokens_per_delta=tokens_per_delta)
    engine.fail_with, engine.fail_after = RuntimeError("CUDA error: an illegal memory access"), 3
    worker = make("w1", group, engine)
    await worker.assign(0)
    req = request(max_tokens=8)
    await worker.handle(req, 0, 0)
    await worker.settle()

    received = 3 - 3 % tokens_per_delta  # a token still in the engine's unfinished delta never left it
    ids, text = expected_completion(req.prompt_token_ids, req.sampling)
    client_text, stream = group.log.client_view(req.request_id)
    assert list(stream.token_ids) == ids[:received] and text.startswith(client_text) and client_text
    assert stream.final is not None and stream.final.finish_reason == "error"
    # what its client is told says nothing of the engine's internals (security review L4): the log has them
    assert stream.final.error_code == ErrorCode.GENERATION_FAILED.value and stream.final.error == ENGINE_FAILED
    (usage,) = group.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.finish_reason) == (4, received, "error")
    assert not worker.intake.fatal.done()  # one failed request never stops the worker


async def test_an_engine_that_dies_mid_stream_stops_the_worker_and_the_next_owner_finishes_the_stream_exactly(
        ) -> None:
    group = FakeGroup()
    dying = FakeEngine()
    dying.fail_with, dying.fail_after = EngineDeadError("the engine core process died"), 3
    w1, w2 = make("w1", group, dying), make("w2", group)
    await w1.assign(0)
    req = request(max_tokens=8)
    await w1.handle(req, 0, 0)
    await w1.settle()
    assert w1.intake.fatal.done() and isinstance(w1.intake.fatal.exception(), EngineDeadError)  # exits non-zero
    assert group.usage == [] and group.log.client_view(req.request_id)[1].final is None  # nothing committed

    await w2.assign(0)  # the group without the dead worker
    await w2.handle(req, 0, 0)
    await w2.settle()
    text, stream = group.log.client_view(req.request_id)
    assert stream.error is None and stream.final is not None
    assert text == expected_completion(req.prompt_token_ids, req.sampling)[1]
    (usage,) = group.usage
    assert (usage.worker_id, usage.prompt_tokens, usage.completion_tokens) == ("w2", 4, 8)
