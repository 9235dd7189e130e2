"""What the worker asks vLLM for: every sampling parameter of a request reaches ``SamplingParams``
(``inference_workers/engine.py``). tests/e2e/test_sampling.py shows that they change what the model generates."""

from __future__ import annotations

import pytest

from inference_workers.engine import VllmEngine
from schemas.events import SamplingSpec

pytestmark = pytest.mark.vllm  # SamplingParams is vLLM's


def test_every_sampling_parameter_of_a_request_reaches_vllm() -> None:
    from vllm.sampling_params import RequestOutputKind

    spec = SamplingSpec(max_tokens=40, temperature=0.7, top_p=0.9, top_k=5, min_tokens=12, seed=7, stop=["\n\n"],
                        ignore_eos=True, repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=-0.5,
                        json_schema='{"type":"object"}', logit_bias={"42": -100.0, "7": 2.5})
    # a field added to the spec and not passed on fails here
    assert set(SamplingSpec.model_fields) == set(spec.model_fields_set)
    params = VllmEngine.sampling_params(spec)
    asked = {name: getattr(params, name) for name in (
        "max_tokens", "temperature", "top_p", "top_k", "min_tokens", "seed", "stop", "ignore_eos",
        "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias")}
    assert asked == {"max_tokens": 40, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_tokens": 12, "seed": 7,
                     "stop": ["\n\n"], "ignore_eos": True, "repetition_penalty": 1.3, "presence_penalty": 0.4,
                     "frequency_penalty": -0.5, "logit_bias": {42: -100.0, 7: 2.5}}
    assert params.structured_outputs is not None and params.structured_outputs.json == '{"type":"object"}'
    assert params.output_kind is RequestOutputKind.DELTA  # the worker streams what each step adds


def test_a_request_without_sampling_parameters_gets_vllms_neutral_defaults() -> None:
    params = VllmEngine.sampling_params(SamplingSpec(max_tokens=8))
    assert (params.temperature, params.top_p, params.min_tokens, params.seed, params.stop) == (1.0, 1.0, 0, None, [])
    assert params.top_k in (0, -1)  # vLLM's "no top-k" (its spelling changed across versions)
    assert (params.repetition_penalty, params.presence_penalty, params.frequency_penalty) == (1.0, 0.0, 0.0)
    assert (params.structured_outputs, params.logit_bias) == (None, None)
