"""Grouped-query attention for decoding a left-padded batch without copying the KV cache.

transformers' SDPA attention hands PyTorch's kernel the grouped-query flag only when there is no attention
mask; a left-padded batch has one, so every layer of every decoding step first copies its KV cache from
the model's KV heads to all query heads (`repeat_kv`: Qwen3 has 2 query heads per KV head, so the copy
writes twice the cache and the kernel reads it again). Decoding is bound by reading the KV cache, so that
copy roughly triples the bytes a step moves.

When one token per row is decoded (query length 1), the query heads that share a KV head can instead be
laid side by side as that KV head's "query positions": (B, H, 1, D) viewed as (B, H_kv, H / H_kv, D). The
padding mask, one row per sequence, applies to each of them alike, so a plain masked SDPA over the KV
heads computes exactly the same attention, reading the cache once and copying nothing. Prompts (query
length > 1, causal) go to transformers' own SDPA path unchanged.

    use_grouped_decode_attention(model)   # the model's attention implementation becomes GROUPED
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

log = logging.getLogger(__name__)

GROUPED = "eviback_grouped_sdpa"


def grouped_sdpa_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                           is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-interface signature: query (B, H, q, D), key/value (B, H_kv, L, D);
    returns (B, q, H, D)."""
    batch, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    if q_len != 1 or heads == kv_heads or dropout or heads % kv_heads:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    grouped = query.reshape(batch, kv_heads, heads // kv_heads, dim)
    mask = attention_mask
    if mask is not None and mask.dim() == 4 and mask.shape[-2] != 1:
        mask = mask[..., -1:, :]  # one query position: its row of the mask
    out = torch.nn.functional.scaled_dot_product_attention(grouped, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(batch, heads, 1, dim).transpose(1, 2).contiguous(), None


_registered = False


def register() -> str:
    """Register the grouped attention (and SDPA's mask format for it) with transformers; returns its name."""
    global _registered
    if not _registered:
        AttentionInterface.register(GROUPED, grouped_sdpa_attention)
        ALL_MASK_ATTENTION_FUNCTIONS.register(GROUPED, sdpa_mask)
        _registered = True
    return GROUPED


def uses_grouped_queries(model: Any) -> bool:
    """Whether the model's attention has fewer KV heads than query heads."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return bool(heads and kv_heads and heads != kv_heads)


def use_grouped_decode_attention(model: Any) -> bool:
    """Switch `model` to the grouped decoding attention when it is an SDPA model with grouped queries;
    returns whether it was switched (a model that cannot switch keeps its attention, with a log line)."""
    current = getattr(model.config, "_attn_implementation", None)
    if current == GROUPED:
        return True
    if current != "sdpa" or not uses_grouped_queries(model):
        return False
    try:
        model.set_attn_implementation(register())
    except (ValueError, AttributeError, NotImplementedError) as e:
        log.info("keeping %s attention for generation: %s", current, e)
        return False
    return getattr(model.config, "_attn_implementation", None) == GROUPED
