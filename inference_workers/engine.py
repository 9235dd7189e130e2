"""vLLM's AsyncLLM behind the worker's :class:`EngineClient` protocol. The only module that imports vLLM.

Continuous batching and prefix caching are vLLM's; this adapter builds the engine from settings (CPU or CUDA
defaults), turns a :class:`SamplingSpec` into ``SamplingParams`` with delta outputs, and maps vLLM's outputs
and errors onto the protocol. For a prompt that ends inside a character (a takeover's), the text is its own
(``continuation_text.py``): vLLM's would repeat the prompt's.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import AsyncGenerator
from functools import cached_property
from typing import Any

from inference_workers.continuation_text import ContinuationText
from inference_workers.protocol import EngineDeadError, EngineDelta
from inference_workers.vllm_plugin import ENGINE_CORE_NAP_ENV, IDLE_SPIN_ENV
from runtime.settings import EngineSettings, ModelSettings
from schemas.events import SamplingSpec

log = logging.getLogger(__name__)


def engine_args(model: ModelSettings, engine: EngineSettings) -> dict[str, Any]:
    """The vLLM engine arguments these settings stand for (also used to start vLLM's own server in bench)."""
    eff = engine.effective()
    args: dict[str, Any] = {
        "model": str(model.path),
        "served_model_name": model.served_name,
        "dtype": eff.dtype,
        "max_model_len": model.max_model_len,
        "max_num_seqs": eff.max_num_seqs,
        "enable_prefix_caching": eff.enable_prefix_caching,
        "enforce_eager": eff.enforce_eager,
        "load_format": eff.load_format,
        "seed": eff.seed,
        "disable_log_stats": True,
        "scheduling_policy": eff.scheduling_policy,
        # One process fewer: the model runs inside the engine-core process (single device).
        "distributed_executor_backend": "uni",
        # Structured outputs by llguidance, the library the gateway validates schemas with
        # (producers/gateway/structured.py), so a schema it accepts never fails here; compact JSON, or a small
        # model pads with whitespace until its max_tokens.
        "structured_outputs_config": {"backend": "guidance", "disable_any_whitespace": True},
    }
    if eff.kv_cache_memory_bytes:
        args["kv_cache_memory_bytes"] = eff.kv_cache_memory_bytes
    if eff.resolved_device == "cuda":
        args["gpu_memory_utilization"] = eff.gpu_memory_utilization
    if eff.max_num_batched_tokens:
        args["max_num_batched_tokens"] = eff.max_num_batched_tokens
    if eff.speculative_config:
        args["speculative_config"] = eff.speculative_config
    return args


def engine_env(engine: EngineSettings) -> dict[str, str]:
    """What vLLM's processes must find in their environment for these settings (also given to vLLM's own server
    in bench): read there by our vLLM plugin."""
    eff = engine.effective()
    spin = {IDLE_SPIN_ENV: eff.idle_spin_s, ENGINE_CORE_NAP_ENV: eff.engine_core_nap_s}
    return {name: str(seconds) for name, seconds in spin.items() if seconds is not None}


class VllmEngine:
    def __init__(self, llm: Any, args: dict[str, Any]) -> None:
        self._llm = llm
        self._args = args

    @classmethod
    def start(cls, model: ModelSettings, engine: EngineSettings) -> VllmEngine:
        """Blocking: spawns the engine-core process, loads the weights, sizes the KV cache."""
        eff = engine.effective()
        # Both are read by vLLM / torch, also in the engine-core process, which inherits this environment.
        os.environ.setdefault("VLLM_CACHE_ROOT", str(eff.cache_dir))
        if eff.omp_num_threads:
            os.environ["OMP_NUM_THREADS"] = str(eff.omp_num_threads)
        os.environ.update(engine_env(engine))
        # Spawned, never forked (vLLM's default on a GPU): a forked engine core would inherit this loop's signal
        # wake-up socket (uvloop sets it when the loop starts, runtime/event_loop.py), and a signal sent to the
        # engine core alone would reach the worker's handlers too. vLLM on the CPU spawns anyway.
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = engine_args(model, engine)
        log.info("starting the vLLM engine", extra={"engine_args": args})
        llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**args))
        return cls(llm, args)

    @property
    def max_num_seqs(self) -> int:
        return int(self._args["max_num_seqs"])

    @property
    def healthy(self) -> bool:
        return not self._llm.errored

    def describe(self) -> dict[str, object]:
        return dict(self._args)

    @staticmethod
    def sampling_params(spec: SamplingSpec) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        structured = None if spec.json_schema is None else StructuredOutputsParams(json=spec.json_schema)
        return SamplingParams(
            max_tokens=spec.max_tokens,
            temperature=spec.temperature,
            top_p=spec.top_p,
            top_k=spec.top_k,
            min_tokens=spec.min_tokens,
            seed=spec.seed,
            stop=spec.stop or None,
            ignore_eos=spec.ignore_eos,
            repetition_penalty=spec.repetition_penalty,
            presence_penalty=spec.presence_penalty,
            frequency_penalty=spec.frequency_penalty,
            structured_outputs=structured,
            logit_bias={int(token): bias for token, bias in spec.logit_bias.items()} or None,
            output_kind=RequestOutputKind.DELTA,
        )

    @cached_property
    def _detokenizer_tokenizer(self) -> Any:
        """The ``tokenizers.Tokenizer`` vLLM's detokenizer steps (FastIncrementalDetokenizer), if it uses one."""
        from vllm.v1.engine.detokenizer import uses_fast_detokenizer

        tokenizer = getattr(self._llm, "tokenizer", None)  # None: vLLM started without one
        return tokenizer._tokenizer if tokenizer is not None and uses_fast_detokenizer(tokenizer) else None

    def _own_text(self, prompt_token_ids: list[int], sampling: SamplingSpec) -> ContinuationText | None:
        """The text to stream instead of vLLM's: only for a prompt ending inside a character. Not with stop strings:
        vLLM holds their text back and truncates it (a takeover of such a request replays from the original prompt,
        which never ends inside a character)."""
        tokenizer = self._detokenizer_tokenizer
        if tokenizer is None or sampling.stop:
            return None
        return ContinuationText.for_prompt(tokenizer, prompt_token_ids)

    async def generate(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingSpec, *,
                       priority: int = 0) -> AsyncGenerator[EngineDelta, None]:
        from vllm.inputs import TokensPrompt
        from vllm.v1.engine.exceptions import EngineDeadError as VllmEngineDead

        params = self.sampling_params(sampling)
        prompt_tokens = len(prompt_token_ids)
        own_text = self._own_text(prompt_token_ids, sampling)
        try:
            # vLLM schedules a lower value first; it refuses a priority under the fcfs policy
            ranked = {"priority": priority} if self._args.get("scheduling_policy") == "priority" else {}
            # NOTE: closed with ours, so a request we stop reading is aborted in vLLM at once (not by the collector).
            async with contextlib.aclosing(self._llm.generate(TokensPrompt(prompt_token_ids=prompt_token_ids),
                                                              params, request_id, **ranked)) as outputs:
                async for out in outputs:
                    completion = out.outputs[0]
                    yield EngineDelta(
                        token_ids=list(completion.token_ids),
                        text=completion.text if own_text is None else own_text.text(completion.token_ids),
                        finish_reason=completion.finish_reason if out.finished else None,
                        prompt_tokens=prompt_tokens,
                        cached_tokens=out.num_cached_tokens or 0,
                    )
        except VllmEngineDead as exc:
            raise EngineDeadError(str(exc)) from exc

    def shutdown(self) -> None:
        self._llm.shutdown()
