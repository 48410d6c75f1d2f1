"""The query encoder of an imported e5 index: e5's conventions, as Search-R1's retrieval server applies them.

A query becomes `"query: " + text`, is tokenised (truncated to 256 tokens, Search-R1's query length), run
through the model, mean-pooled over its non-padding tokens and L2-normalised. Any local Hugging Face model
directory works (a sentence-transformers directory holds one at its root), e.g. a downloaded
`intfloat/e5-base-v2`; nothing is downloaded. The pooling is computed here rather than by
sentence-transformers so that a plain Hugging Face directory and a sentence-transformers one give the same
vectors, the ones Search-R1's index was built with.

torch and transformers are imported when an encoder is made: reading an index's manifest does not load them.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from eviback.device import Placement, place, record


class QueryEncoder(Protocol):
    """What an imported index needs to turn queries into vectors: `dim` and `encode(texts)`, shape
    (len(texts), dim), float32. The prefix is the encoder's business."""

    dim: int

    def encode(self, texts: Sequence[str]) -> np.ndarray: ...


POOLINGS = ("mean", "cls")


def model_dimension(model: str | os.PathLike) -> int:
    """The output width of a local Hugging Face model, from its `config.json` (no weights loaded)."""
    path = Path(model) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"query encoder {model!r} is not a local Hugging Face model directory (no "
                                "config.json); give the path of a downloaded model such as intfloat/e5-base-v2")
    config = json.loads(path.read_text())
    for key in ("hidden_size", "dim", "d_model"):
        if isinstance(config.get(key), int):
            return int(config[key])
    raise ValueError(f"{path} names no hidden_size: cannot tell the width of the query encoder")


class E5QueryEncoder:
    """A local Hugging Face encoder used the e5 way: prefix, mean pooling (or CLS), L2 normalisation.

    Runs in float32 on `device` (a setting, see :data:`eviback.device.HELP`; default auto: the local GPU when
    there is one); each batch of tokens is put on the model's device and the vectors come back to the CPU.
    Thread-safe (a lock around tokenisation and the forward pass: a fast tokenizer refuses concurrent use)."""

    def __init__(self, model: str | os.PathLike, *, prefix: str = "query: ", pooling: str = "mean",
                 max_length: int = 256, normalize: bool = True, batch_size: int = 64,
                 device: str | Placement = "auto") -> None:
        if pooling not in POOLINGS:
            raise ValueError(f"unknown pooling {pooling!r}; choose one of {', '.join(POOLINGS)}")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a path must never turn into a download attempt
        import torch
        from transformers import AutoModel, AutoTokenizer

        self.dim = model_dimension(model)
        self.prefix, self.pooling, self.max_length = prefix, pooling, max_length
        self.normalize, self.batch_size = normalize, batch_size
        self._torch = torch
        self._tokenizer = AutoTokenizer.from_pretrained(str(model))
        # float32 on every device: the query vectors must be the arithmetic the index's vectors were made with
        placement = place(device, "float32")
        self._model: Any = AutoModel.from_pretrained(str(model), dtype=torch.float32).to(placement.torch_device)
        self._model.eval()
        record("dense encoder", self._model, placement)
        self._lock = threading.Lock()

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        torch = self._torch
        parts = []
        with self._lock, torch.inference_mode():
            for start in range(0, len(texts), self.batch_size):
                batch = [self.prefix + text for text in texts[start:start + self.batch_size]]
                tokens = self._tokenizer(batch, padding=True, truncation=True, max_length=self.max_length,
                                         return_tensors="pt").to(self._model.device)
                hidden = self._model(**tokens).last_hidden_state
                if self.pooling == "mean":
                    mask = tokens["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                    pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
                else:
                    pooled = hidden[:, 0]
                if self.normalize:
                    pooled = torch.nn.functional.normalize(pooled, dim=-1)
                parts.append(pooled.float().cpu().numpy())
        if not parts:
            return np.zeros((0, self.dim), dtype=np.float32)
        return np.ascontiguousarray(np.concatenate(parts), dtype=np.float32)
