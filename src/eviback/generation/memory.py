"""The memory arithmetic of the generation engines: what a KV cache holds, how many rows one HF `generate`
call may take, how large the vLLM CPU engine's cache is, and what share of a GPU an in-process vLLM engine
may take beside a trainer. Pure functions over numbers (and a checkpoint's `config.json`): the engines and the
runner read the inputs (free memory, the model's shape) and call these, so every rule is tested on its own.

    shape = ModelShape.from_checkpoint("runs/warm")           # layers, KV heads, ... of a saved model
    shape.kv_bytes_per_token(2)                                # bf16 keys and values of every layer
    hf_rows_per_call(rows=256, width=1500, cap=500, free_bytes=40 * GIB, shape=shape, dtype_bytes=2)
    engine_share(total_bytes=80 * GIB, engine_weight_bytes=..., kv_bytes=..., trainer_resident_bytes=...)

Figures to hold on to (bf16): Qwen3-0.6B and 1.7B keep 112 KiB of keys and values per token (28 layers, 8 KV
heads of 128), Qwen3-4B 144 KiB (36 layers); SmolLM2-135M 22.5 KiB (30 layers, 3 KV heads of 64). One step of
Search-R1's batch (512 rollouts of up to 4,096 tokens) at 0.6B holds 224 GiB: more than a GPU, so rollouts run
in waves whatever the settings; 80 rollouts hold 35 GiB.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GIB = 1024 ** 3


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int = 2) -> int:
    """Bytes of keys and values one token occupies in a KV cache (every layer)."""
    if min(layers, kv_heads, head_dim, dtype_bytes) < 0:
        raise ValueError("a model's shape and its dtype's bytes must be >= 0")
    return 2 * layers * kv_heads * head_dim * dtype_bytes


def kv_gib(tokens: int, bytes_per_token: int) -> float:
    """GiB of KV cache that `tokens` tokens occupy, e.g. for sizing `kv_cache_gib` or `gpu_memory_utilization`
    by hand: 80 rollouts x 4,096 tokens of Qwen3-0.6B (112 KiB each) take 35 GiB."""
    if tokens < 0 or bytes_per_token < 0:
        raise ValueError("tokens and bytes per token must be >= 0")
    return tokens * bytes_per_token / GIB


@dataclass(frozen=True)
class ModelShape:
    """What a decoder's memory depends on: its layers, KV heads and their width, hidden and MLP widths, and
    its vocabulary."""

    layers: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int

    @classmethod
    def from_config(cls, config: Any) -> ModelShape:
        """From a transformers config object or a config.json mapping (a multimodal config's text part)."""
        values = config if isinstance(config, dict) else config.to_dict()
        values = values.get("text_config") or values
        heads = values["num_attention_heads"]
        hidden = values["hidden_size"]
        return cls(layers=values["num_hidden_layers"], kv_heads=values.get("num_key_value_heads") or heads,
                   head_dim=values.get("head_dim") or hidden // heads, hidden=hidden,
                   intermediate=values.get("intermediate_size") or 4 * hidden, vocab=values.get("vocab_size") or 0)

    @classmethod
    def from_checkpoint(cls, model_dir: str | os.PathLike) -> ModelShape | None:
        """From a Hugging Face checkpoint's config.json; None when there is none or it lacks a field."""
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            return None
        try:
            return cls.from_config(json.loads(path.read_text()))
        except (KeyError, TypeError, ZeroDivisionError, ValueError):
            return None

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        return kv_bytes_per_token(self.layers, self.kv_heads, self.head_dim, dtype_bytes)

    def prefill_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """Transient activation bytes per prompt token of a no-grad forward: one layer's at a time (queries,
        keys and values, the attention output, the MLP's gate, up and product, and an fp32 residual stream),
        an upper estimate."""
        return (4 * self.hidden + 3 * self.intermediate) * dtype_bytes + 4 * self.hidden

    def sampling_bytes_per_row(self) -> int:
        """Per-row bytes of one decoding step's sampling: a few fp32 copies of the vocabulary's logits (the
        scores, their log-softmax, the probabilities, the one-hot result)."""
        return 6 * 4 * self.vocab


# ---- the HF engine: rows per generate call


def hf_rows_per_call(*, rows: int, width: int, cap: int, free_bytes: int, shape: ModelShape, dtype_bytes: int = 2,
                     margin: float = 0.1) -> int:
    """The most rows of one `generate` call that fit `free_bytes` (1..rows): each row holds a KV cache of
    `width` (its padded prompt) + `cap` (its new tokens) tokens, its share of the prefill's activations and a
    few vocabulary-sized rows of sampling; `margin` of the free memory is kept back (fragmentation, the
    allocator's rounding). At least 1, even when one row does not fit (generation then fails as it would
    have, with the device's own out-of-memory error)."""
    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}")
    per_row = ((width + cap) * shape.kv_bytes_per_token(dtype_bytes) + width * shape.prefill_bytes_per_token(dtype_bytes)
               + shape.sampling_bytes_per_row())
    usable = max(0, int(free_bytes * (1 - margin)))
    return max(1, min(rows, usable // per_row))


def even_batches(count: int, most: int) -> list[int]:
    """`count` rows split into as few calls of at most `most` rows as possible, as even as possible (the
    calls' sizes, largest first): 10 rows of at most 4 -> [4, 3, 3]."""
    if count < 0 or most < 1:
        raise ValueError(f"count must be >= 0 and most >= 1, got {count}, {most}")
    if count == 0:
        return []
    calls = math.ceil(count / most)
    base, extra = divmod(count, calls)
    return [base + 1] * extra + [base] * (calls - extra)


# ---- the vLLM CPU engine: its KV cache


def cpu_kv_cache_gib(sequences: int, max_context: int, bytes_per_token: int, *, headroom: float = 1.5,
                     step_gib: float = 0.25, floor_gib: float = 0.5, ceiling_gib: float = 2.0) -> float:
    """GiB of KV cache for the vLLM CPU engine (which allocates it up front: 2 GiB unless told) to hold
    `sequences` concurrent sequences of up to `max_context` tokens, times `headroom`, rounded up to a multiple
    of `step_gib` and kept within [floor_gib, ceiling_gib]; more sequences run in waves.

    SmolLM2-135M (30 layers, 3 KV heads of 64, bf16) takes 23,040 bytes per token: the demo's 8 rollouts x
    1,592 tokens need 0.27 GiB (0.5 GiB planned, instead of vLLM's 2); `eviback train`'s defaults, 20 x 3,012
    tokens, 1.29 GiB (2 GiB planned)."""
    need = sequences * max_context * bytes_per_token * headroom / GIB
    return min(ceiling_gib, max(floor_gib, -(-need // step_gib) * step_gib))


def cpu_rollout_kv_cache_gib(sequences: int, max_context: int, model_dir: str, dtype: str = "bfloat16") -> float | None:
    """:func:`cpu_kv_cache_gib` for a run's CPU engine computing in `dtype` (fp32 keys and values take twice
    bf16's bytes); None (the engine's own default) when the user set `VLLM_CPU_KVCACHE_SPACE` or the model's
    shape cannot be read."""
    shape = ModelShape.from_checkpoint(model_dir)
    if "VLLM_CPU_KVCACHE_SPACE" in os.environ or shape is None:
        return None
    return cpu_kv_cache_gib(sequences, max_context, shape.kv_bytes_per_token(4 if dtype == "float32" else 2))


# ---- the vLLM CUDA engine beside a trainer: its share of the GPU


ENGINE_OVERHEAD_BYTES = 2 * GIB  # vLLM's profiled activations, CUDA graphs and its CUDA context, beyond weights and KV
GPU_MARGIN_BYTES = 2 * GIB  # kept free for the allocator's fragmentation and other CUDA contexts
UTILIZATION_FLOOR = 0.05  # vLLM needs some memory to start at all
STANDALONE_UTILIZATION = 0.85  # an engine that shares its GPU with no trainer (evaluation)


@dataclass(frozen=True)
class EngineShare:
    """The share of a GPU an in-process vLLM engine takes beside a trainer (vLLM's `gpu_memory_utilization`),
    and the arithmetic behind it, in bytes."""

    utilization: float
    total: int  # the GPU's memory
    engine: int  # what the engine needs: its weights, one step's KV cache with headroom, its overhead
    trainer: int  # what the trainer keeps on the GPU while the engine generates
    kv: int  # one step's KV cache, without headroom

    def describe(self) -> str:
        return (f"the rollout engine takes {self.utilization:.2f} of the GPU's {self.total / GIB:.1f} GiB: its weights, "
                f"one step's KV cache ({self.kv / GIB:.1f} GiB, x1.25) and {ENGINE_OVERHEAD_BYTES / GIB:.0f} GiB of "
                f"overhead = {self.engine / GIB:.1f} GiB, beside the trainer's {self.trainer / GIB:.1f} GiB")


def engine_share(*, total_bytes: int, engine_weight_bytes: int, kv_bytes: int, trainer_resident_bytes: int,
                 kv_headroom: float = 1.25) -> EngineShare:
    """The `gpu_memory_utilization` of an in-process vLLM engine that shares a GPU of `total_bytes` with a
    trainer holding `trainer_resident_bytes` while the engine generates (its weights, optimiser state and
    reference model: docs/training.md's arithmetic; the update's gradients and activations come while the
    engine sleeps). The engine gets its weights, `kv_bytes` (one step's rollouts at full length) x
    `kv_headroom` and its overhead; when more is free it gets no more (a step's rollouts never need it, and
    the trainer's update can use it). Raises ValueError, with the arithmetic and what to change, when the two
    do not fit."""
    engine = int(engine_weight_bytes + kv_bytes * kv_headroom + ENGINE_OVERHEAD_BYTES)
    available = total_bytes - trainer_resident_bytes - GPU_MARGIN_BYTES
    share = EngineShare(utilization=0.0, total=total_bytes, engine=engine, trainer=trainer_resident_bytes, kv=kv_bytes)
    if engine > available:
        if engine_weight_bytes + ENGINE_OVERHEAD_BYTES + kv_bytes * 0.25 > available:
            raise ValueError(f"the trainer keeps {trainer_resident_bytes / GIB:.1f} GiB on a GPU of "
                             f"{total_bytes / GIB:.1f} GiB, which leaves the rollout engine too little for its weights "
                             f"and a quarter of one step's KV cache (it needs {engine / GIB:.1f} GiB in all): give "
                             "generation a GPU of its own (backend=vllm-server, `eviback serve-policy`), or train a "
                             "smaller model, or set gpu_memory_utilization yourself")
        # less than a whole step's cache: vLLM schedules the rollouts in waves (slower, still correct)
        utilization = math.floor(available / total_bytes * 100) / 100
        return EngineShare(utilization=max(UTILIZATION_FLOOR, utilization), total=total_bytes, engine=available,
                           trainer=trainer_resident_bytes, kv=kv_bytes)
    utilization = max(UTILIZATION_FLOOR, math.ceil(engine / total_bytes * 100) / 100)
    return EngineShare(utilization=min(utilization, 1.0), total=share.total, engine=engine, trainer=share.trainer,
                       kv=share.kv)
