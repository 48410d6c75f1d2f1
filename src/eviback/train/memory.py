"""Memory planning for a training run: how large the generation engine's KV cache needs to be.

vLLM's CPU engine allocates its KV cache up front (2 GiB unless told; `VLLM_CPU_KVCACHE_SPACE` in whole GiB). A rollout
step needs far less than that for a small model: each of its sequences holds at most `max_context` tokens
of keys and values. The cache is sized to one step's sequences
at full length, with headroom, within a floor and a ceiling; more concurrent sequences (e.g. a held-out
evaluation of many questions) are scheduled in waves by the engine instead of failing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
from pathlib import Path

from eviback.generation.base import kv_bytes_per_token

GIB = 1024 ** 3


def kv_cache_gib(sequences: int, max_context: int, bytes_per_token: int, *, headroom: float = 1.5,
                 step_gib: float = 0.25, floor_gib: float = 0.5, ceiling_gib: float = 2.0) -> float:
    """GiB of KV cache for `sequences` concurrent sequences of up to `max_context` tokens, times `headroom`,
    rounded up to a multiple of `step_gib` and kept within [floor_gib, ceiling_gib].

    SmolLM2-135M (30 layers, 3 KV heads of 64, bf16) takes 23,040 bytes per token: the demo's 8 rollouts x
    1,592 tokens need 0.27 GiB (0.5 GiB planned, instead of vLLM's 2); `eviback train`'s defaults, 20 x 3,012
    tokens, 1.29 GiB (2 GiB planned)."""
    need = sequences * max_context * bytes_per_token * headroom / GIB
    return min(ceiling_gib, max(floor_gib, -(-need // step_gib) * step_gib))


def model_kv_bytes_per_token(model_dir: str, dtype_bytes: int = 2) -> int | None:
    """`kv_bytes_per_token` from a Hugging Face checkpoint's config.json; None when it cannot be read."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return None
    config = json.loads(path.read_text())
    config = config.get("text_config", config)
    try:
        heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        return kv_bytes_per_token(config["num_hidden_layers"], config.get("num_key_value_heads", heads), head_dim,
                                  dtype_bytes)
    except (KeyError, TypeError, ZeroDivisionError):
        return None


def rollout_kv_cache_gib(sequences: int, max_context: int, model_dir: str, dtype: str = "bfloat16") -> float | None:
    """The KV cache for a run's rollout engine (see :func:`kv_cache_gib`) computing in `dtype` (the cache
    holds keys and values in the model's dtype: fp32 takes twice bf16's bytes); None (the engine's own
    default) when `VLLM_CPU_KVCACHE_SPACE` is set by the user or the model's shape cannot be read."""
    per_token = model_kv_bytes_per_token(model_dir, 4 if dtype == "float32" else 2)
    if "VLLM_CPU_KVCACHE_SPACE" in os.environ or per_token is None:
        return None
    return kv_cache_gib(sequences, max_context, per_token)


def release_free_heap() -> bool:
    """Hand the C heap's free pages back to the OS (glibc's `malloc_trim`); False where unavailable.

    Tensors of a training step come and go in many sizes; glibc keeps freed blocks in its arenas, so without
    this a long run's resident memory grows step after step although the live tensors do not."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return False
    trim(0)
    return True
