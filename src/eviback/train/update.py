"""The fast GRPO update: per-token log-probabilities of a padded batch without padding, without prompt
or observation positions in the LM head, and without full-vocabulary fp32 logits.

TRL's GRPOTrainer scores a micro-batch as one padded (B, P + C) tensor: every row is padded to the longest
prompt and the longest completion of the whole generation batch, and (on devices without Triton) its fused
LM head projects every position, prompt and padding included, onto the vocabulary, with fp32 matmuls in
the backward pass. Here the rows run through the decoder at their own lengths (plain causal attention; rows
of similar length share a right-padded batch, `length_buckets`), and only the positions whose log-probability
is read later (the model's own tokens) go through the LM head, in chunks of `chunk_tokens` positions, with
bf16 matmuls and the softmax in fp32.

    plan = score_plan(attention_mask, logits_to_keep, score_mask)      # which tokens, where they go
    out = padding_free_logprobs(model, input_ids, plan, temperature)   # (B, C) fp32 log-probs, entropies

What is computed is what TRL computes: the log-probability of each next token under the temperature-scaled
distribution, in fp32, from logits that are the bf16 product of bf16 hidden states and bf16 LM-head
weights (TRL's CPU path rounds its logit tiles to bf16 too; `logits_dtype=torch.float32` computes them in
fp32 instead, at fp32 matmul speed). Positions outside `score_mask` read 0.0: every consumer in TRL's loss
(the policy term, the KL term, the importance-sampling ratio, the entropy and clipping metrics) multiplies
them by that mask. A row with no scored position is not run at all (its loss terms are zero either way).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.function import FunctionCtx


@dataclass(frozen=True)
class ScorePlan:
    """Where the scored tokens of a padded batch are, in the layout TRL uses.

    The batch is (B, L) = left-padded prompts followed by right-padded completions; the output is the last
    C = `logits_to_keep` columns. Every tensor below has one entry per scored token (N of them), ordered by
    row, then position.

    Attributes:
        rows: per run row, (row index, first real column, one past the last real column); rows without a
            scored token are left out.
        hidden_index: (N,) long, index of the hidden state that predicts the token, in the concatenation of
            the run rows' hidden states (each row's real tokens, in `rows` order).
        target_column: (N,) long, the token's column in the padded (B, L) batch.
        out_index: (N,) long, the token's flat index in the (B, C) output.
        shape: (B, C), the output shape.
    """

    rows: tuple[tuple[int, int, int], ...]
    hidden_index: torch.Tensor
    target_column: torch.Tensor
    out_index: torch.Tensor
    shape: tuple[int, int]

    def to(self, device: torch.device | str) -> ScorePlan:
        """The plan with its index tensors on `device` (where the batch it indexes is)."""
        return ScorePlan(self.rows, self.hidden_index.to(device), self.target_column.to(device),
                         self.out_index.to(device), self.shape)

    @property
    def tokens(self) -> int:
        """N, the number of scored tokens."""
        return int(self.out_index.numel())

    @property
    def run_tokens(self) -> int:
        """Tokens that go through the decoder (the real tokens of the run rows, padding excluded)."""
        return sum(end - start for _, start, end in self.rows)


def score_plan(attention_mask: torch.Tensor, logits_to_keep: int,
               score_mask: torch.Tensor | None = None) -> ScorePlan | None:
    """The plan for a (B, L) `attention_mask` whose last `logits_to_keep` columns are the completions.

    `score_mask` (B, C), when given, restricts scoring to its nonzero positions (e.g. completion mask x
    tool mask); otherwise every real completion token is scored. Returns None when a row's real tokens are
    not one contiguous run (a layout this path does not handle; the caller falls back to TRL's).

    The plan's decisions depend on the masks' values, so they are made on the host, from one copy of the masks
    (on a GPU, deciding row by row on the device would synchronise once per row); its index tensors are then
    put on the masks' device, where the batch they index is. The tensor work that follows
    (:func:`padding_free_logprobs`) makes no data-dependent decision."""
    device = attention_mask.device
    mask = attention_mask.detach().to("cpu").bool()
    batch, length = mask.shape
    first = length - logits_to_keep
    if score_mask is not None and tuple(score_mask.shape) != (batch, logits_to_keep):
        raise ValueError(f"score_mask has shape {tuple(score_mask.shape)}, expected {(batch, logits_to_keep)}")
    scoring = score_mask.detach().to("cpu").bool() if score_mask is not None else None
    rows, hidden, target, out = [], [], [], []
    offset = 0
    for b in range(batch):
        real = torch.nonzero(mask[b]).flatten()
        if real.numel() == 0:
            continue
        start, end = int(real[0]), int(real[-1]) + 1
        if end - start != real.numel():
            return None  # a hole inside the row
        scored = mask[b, first:].clone()
        if scoring is not None:
            scored &= scoring[b]
        columns = torch.nonzero(scored).flatten() + first
        columns = columns[columns > start]  # the first real token has no prediction
        if columns.numel() == 0:
            continue
        rows.append((b, start, end))
        hidden.append(columns - 1 - start + offset)
        target.append(columns)
        out.append(b * logits_to_keep + columns - first)
        offset += end - start
    empty = torch.zeros(0, dtype=torch.long, device="cpu")
    return ScorePlan(
        rows=tuple(rows),
        hidden_index=torch.cat(hidden) if hidden else empty,
        target_column=torch.cat(target) if target else empty,
        out_index=torch.cat(out) if out else empty,
        shape=(batch, logits_to_keep),
    ).to(device)


class _ChunkedTokenLogprobs(torch.autograd.Function):
    """log softmax(hidden @ weight.T / T)[target] for N positions, `chunk` positions at a time.

    Every matmul, forward and backward, computes in `compute` (the caller resolves it: the autocast dtype
    when autocast is on, so that a GPU's fp32 weights under bf16 autocast run bf16 matmuls in both passes,
    and the backward's probabilities are the forward's), with autocast off inside so that the casts are
    these. Forward: each chunk's (chunk, V) logits are scaled and soft-maxed in fp32; the per-token
    log-partition is kept. The chunk's logits are kept for the backward pass while they fit in `keep_bytes`
    in all (counted in `compute`'s bytes), else recomputed there, the same way. Backward: the logits'
    gradient (onehot - p) * g / T is formed in fp32 per chunk and rounded to `compute` for the two gradient
    matmuls; the weight gradient is accumulated in fp32 across chunks and returned in the weight's dtype, the
    hidden states' gradient in theirs. The entropy is an output without gradient."""

    @staticmethod
    def forward(ctx: FunctionCtx, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, inv_t: float,
                chunk: int, compute: torch.dtype, keep_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = hidden.shape[0]
        logps = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty_like(logps)
        log_z = torch.empty_like(logps)
        kept: list[torch.Tensor] = []
        keep = n * weight.shape[0] * torch.finfo(compute).bits // 8 <= keep_bytes
        with _autocast_off(hidden.device.type):
            w = weight.to(compute)
            for s in range(0, n, chunk):
                e = min(s + chunk, n)
                z = hidden[s:e].to(compute) @ w.t()  # (n_c, V)
                zf = z.float() * inv_t  # out of place: `z` may be fp32 already, and is kept
                lz = torch.logsumexp(zf, dim=-1)
                log_z[s:e] = lz
                logps[s:e] = zf.gather(1, target[s:e, None]).squeeze(1) - lz
                # entropy = log Z - sum_v p_v z_v
                p = zf.sub(lz[:, None]).exp_()
                entropy[s:e] = lz - (p * zf).sum(-1)
                if keep:
                    kept.append(z)
        ctx.save_for_backward(hidden, weight, target, log_z)
        ctx.kept = kept
        ctx.inv_t, ctx.chunk, ctx.compute = inv_t, chunk, compute
        ctx.mark_non_differentiable(entropy)
        return logps, entropy

    @staticmethod
    def backward(ctx: FunctionCtx, grad_logps: torch.Tensor | None,
                 _grad_entropy: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, target, log_z = ctx.saved_tensors
        inv_t, chunk, compute = ctx.inv_t, ctx.chunk, ctx.compute
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        n = hidden.shape[0]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        g_all = grad_logps.float() if grad_logps is not None else torch.zeros_like(log_z)
        with _autocast_off(hidden.device.type):
            w = weight.to(compute)
            for i, s in enumerate(range(0, n, chunk)):
                e = min(s + chunk, n)
                h = hidden[s:e].to(compute)
                z = ctx.kept[i] if ctx.kept else h @ w.t()
                g = g_all[s:e]
                # d logp_t / d z_v = (onehot_t(v) - p_v) / T
                grad_z = z.float().mul_(inv_t).sub_(log_z[s:e, None]).exp_().mul_(-g[:, None])
                grad_z[torch.arange(e - s, device=grad_z.device), target[s:e]] += g
                grad_z = grad_z.mul_(inv_t).to(compute)
                if need_h:
                    grad_h[s:e] = (grad_z @ w).to(hidden.dtype)
                if need_w:
                    grad_w += (grad_z.t() @ h).float()
        ctx.kept = None
        return grad_h, (grad_w.to(weight.dtype) if need_w else None), None, None, None, None, None


def _autocast_off(device_type: str) -> contextlib.AbstractContextManager:
    """Autocast off on `device_type` inside the block (a device without autocast: nothing to turn off)."""
    if torch.amp.is_autocast_available(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def logits_compute_dtype(hidden: torch.Tensor, logits_dtype: torch.dtype | None = None) -> torch.dtype:
    """The dtype the LM head's matmuls compute in: `logits_dtype` when given (TRL's `cast_lm_head_to_fp32`),
    else the autocast dtype when autocast is on for `hidden`'s device (a GPU's fp32 weights under bf16
    autocast compute bf16 matmuls, as every other layer of the model does), else `hidden`'s dtype."""
    if logits_dtype is not None:
        return logits_dtype
    kind = hidden.device.type
    if torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return hidden.dtype


def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *, temperature: float = 1.0,
                   chunk_tokens: int = 512, logits_dtype: torch.dtype | None = None,
                   keep_logits_bytes: int = 1 << 30) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability and entropy of the temperature-scaled next-token distribution at N positions.

    Args:
        hidden: (N, H) final hidden states (after the model's last norm).
        weight: (V, H) LM-head weight (no bias).
        target: (N,) long, the token whose log-probability is wanted at each position.
        temperature: logits are divided by it (TRL's `temperature`).
        chunk_tokens: positions per (chunk, V) logits tile; peak extra memory is a few such tiles in fp32.
        logits_dtype: dtype of the logits matmuls, forward and backward (default: :func:`logits_compute_dtype`:
            the autocast dtype under autocast, else `hidden`'s dtype, as in TRL's CPU path).
        keep_logits_bytes: keep the forward's logits for the backward when they fit, else recompute them.

    Returns:
        (logps, entropy), both (N,) fp32; `logps` carries the gradient, `entropy` none.
    """
    if hidden.shape[0] == 0:
        # Nothing to score: an output still connected to the weight, so that backward() runs (zero grads).
        zero = hidden.new_zeros(0, dtype=torch.float32)
        return zero + 0.0 * weight[0, 0], zero
    return _ChunkedTokenLogprobs.apply(hidden, weight, target, 1.0 / temperature, chunk_tokens,
                                       logits_compute_dtype(hidden, logits_dtype), keep_logits_bytes)


@dataclass(frozen=True)
class PaddedLogprobs:
    """Log-probabilities of a padded batch: `logps` and `entropy` are (B, C) fp32, 0.0 where not scored."""

    logps: torch.Tensor
    entropy: torch.Tensor
    scored_tokens: int  # N, positions through the LM head
    run_tokens: int  # tokens through the decoder


def length_buckets(lengths: list[int], *, token_budget: int = 16384, max_padding: float = 0.2) -> list[list[int]]:
    """Group rows (indices into `lengths`) into buckets run as one right-padded batch each.

    Rows are taken longest first; a row joins the current bucket while the bucket, padded to its longest
    row, stays within `token_budget` tokens and its padding share within `max_padding`. Fewer, larger
    batches mean fewer (small, thread-synchronised) kernel launches, which matters on a busy CPU; the bound
    keeps the padding they cost small. `max_padding=0` runs every row alone (unless lengths are equal)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    buckets: list[list[int]] = []
    for i in order:
        if buckets:
            bucket = buckets[-1]
            longest = lengths[bucket[0]]
            padded = longest * (len(bucket) + 1)
            real = sum(lengths[j] for j in bucket) + lengths[i]
            if padded <= token_budget and (padded - real) <= max_padding * padded:
                bucket.append(i)
                continue
        buckets.append([i])
    return buckets


def padding_free_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, plan: ScorePlan, *,
                          temperature: float = 1.0, chunk_tokens: int = 512,
                          logits_dtype: torch.dtype | None = None, token_budget: int = 16384,
                          max_padding: float = 0.2) -> PaddedLogprobs:
    """Score `plan`'s tokens of the padded (B, L) `input_ids` with a causal LM.

    The run rows go through `model.base_model` (the decoder without its LM head) in length buckets
    (:func:`length_buckets`), each bucket right-padded to its longest row, without an attention mask: under
    causal attention a row's real tokens never see the padding after them, so their hidden states are the
    row's own (and the padding gets no gradient). The hidden states of the scored positions are gathered and
    sent through :func:`token_logprobs` with `model.get_output_embeddings().weight`. With gradients enabled,
    every bucket's graph is kept until the caller's backward pass (no recomputation)."""
    decoder = model.base_model
    head = model.get_output_embeddings()
    lengths = [end - start for _, start, end in plan.rows]
    states: list[torch.Tensor | None] = [None] * len(plan.rows)
    for bucket in length_buckets(lengths, token_budget=token_budget, max_padding=max_padding):
        longest = lengths[bucket[0]]
        ids = input_ids.new_zeros(len(bucket), longest)
        for k, i in enumerate(bucket):
            b, start, end = plan.rows[i]
            ids[k, :end - start] = input_ids[b, start:end]
        out = decoder(input_ids=ids, use_cache=False).last_hidden_state  # (rows, longest, H)
        for k, i in enumerate(bucket):
            states[i] = out[k, :lengths[i]]
    batch, keep = plan.shape
    if states:
        hidden = torch.cat(states).index_select(0, plan.hidden_index.to(head.weight.device))
    else:
        hidden = head.weight.new_zeros(0, head.weight.shape[1])
    target = input_ids.flatten().index_select(
        0, (plan.out_index // keep) * input_ids.shape[1] + plan.target_column).to(hidden.device)
    logps, entropy = token_logprobs(hidden, head.weight, target, temperature=temperature,
                                    chunk_tokens=chunk_tokens, logits_dtype=logits_dtype)
    index = plan.out_index.to(logps.device)
    flat = torch.zeros(batch * keep, dtype=torch.float32, device=logps.device)
    full_logps = flat.index_put((index,), logps).view(batch, keep)
    full_entropy = flat.index_put((index,), entropy).view(batch, keep)
    return PaddedLogprobs(full_logps, full_entropy, plan.tokens, plan.run_tokens)


def call_through_wrapper(wrapper: torch.nn.Module, module: torch.nn.Module, compute: Callable[[], Any]) -> Any:
    """`compute()` run as `wrapper`'s forward pass, `wrapper` being a DistributedDataParallel around `module`.

    DDP all-reduces the gradients of a backward pass only after a forward pass through the wrapper itself
    (its forward prepares the reducer for the coming backward); a computation that calls the inner module's
    parts directly (here the decoder, then the chunked LM head on its weight) would leave every process with
    its own gradients. So `module`'s forward is replaced, for this one call, by `compute`, and the wrapper is
    called. The module's own `forward` attribute (accelerate's mixed-precision wrapper sets one) is put back."""
    saved = module.__dict__.get("forward")
    module.forward = lambda *args, **kwargs: compute()
    try:
        return wrapper()
    finally:
        if saved is None:
            del module.forward
        else:
            module.forward = saved


def importance_ratio(old: torch.Tensor, sampling: torch.Tensor, mask: torch.Tensor, *, mode: str = "token_truncate",
                     cap: float | None = 2.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The truncated importance ratio of the behaviour-policy correction, as TRL's vLLM path computes it,
    and its figures.

    `old` and `sampling` are (B, C) log-probs of the sampled tokens under the trainer and under the engine
    (NaN where the engine gave none: ratio 1 there). Returns the ratio, (B, C) for `token_truncate` or (B, 1)
    for `sequence_truncate`, clamped at `cap`, and a (7,) tensor of sums for logging: sum, count and max of
    |old - sampling| over the masked tokens with a value; min, sum, count and max of the ratio (over the
    masked tokens, or the rows)."""
    if mode not in ("token_truncate", "sequence_truncate"):
        raise ValueError(f"mode must be token_truncate or sequence_truncate, got {mode!r}")
    diff = torch.nan_to_num((old - sampling) * mask, nan=0.0)
    if mode == "sequence_truncate":
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if cap is not None:
        ratio = ratio.clamp(max=cap)
    # The figures by masked reductions on the device (no boolean indexing: its output size depends on the
    # data), sent to the host in one copy.
    delta = (old - sampling).abs()
    valid = mask.bool() & ~torch.isnan(delta)
    counted = torch.ones_like(ratio, dtype=torch.bool) if mode == "sequence_truncate" else mask.bool()
    inf = torch.full((), float("inf"), device=ratio.device)
    if ratio.numel() == 0:
        return ratio, torch.tensor([0.0, 0.0, -float("inf"), float("inf"), 0.0, 0.0, -float("inf")], device="cpu")
    stats = torch.stack([
        torch.where(valid, delta, 0.0).sum(), valid.sum(), torch.where(valid, delta, -inf).max(),
        torch.where(counted, ratio, inf).min(), torch.where(counted, ratio, 0.0).sum(), counted.sum(),
        torch.where(counted, ratio, -inf).max(),
    ]).float().cpu()
    return ratio, stats
