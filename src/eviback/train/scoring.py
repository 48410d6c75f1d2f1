"""TRL's log-probability passes made cheaper, as one unit on top of `GRPOTrainer` (trl==1.16.0).

Two changes to how TRL scores a generation batch, switched on and off together by
:class:`ScoringSettings` (`ScoringSettings.trl()` is TRL's own path, which bench_update.py compares with):

- **Padding-free scoring.** TRL scores each micro-batch padded to the generation batch's longest prompt and
  completion and, on CPU, projects every position (prompts and padding included) onto the vocabulary. Here
  the rows run at their real lengths (similar lengths batched, right-padded) and only the tokens whose
  log-probability is read (the model's own tokens: completion mask x tool mask) go through a chunked LM head
  (:mod:`eviback.train.update`). The loss, the KL term and the importance ratio stay TRL's own, on the same
  fp32 log-probabilities.
- **The deferred importance ratio.** With the behaviour correction on, TRL runs the policy once more after
  the rollouts (no grad) for the "old" log-probs: the importance ratio's numerator and the PPO ratio's
  denominator. With one optimiser step per generation batch (num_iterations == 1) the weights do not change
  between that pass and each micro-batch's loss pass, so both are the loss pass's own log-probs: the old
  pass is skipped (a NaN placeholder stands in for it), and each micro-batch's importance ratio and the
  logged engine/trainer differences are computed from its loss pass instead. One forward pass over the
  whole batch fewer per step; tests/test_train_grpo.py compares the two ways on the same step.

What the passes of one generation batch hand to each other between TRL's calls is one record,
:class:`ScoringState`, made afresh for each generation batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from trl import GRPOTrainer

from eviback.settings import check_fields
from eviback.train.lora import adapters_enabled, causal_lm
from eviback.train.memory import release_free_heap
from eviback.train.update import call_through_wrapper, importance_ratio, padding_free_logprobs, score_plan

# TRL's logged engine/trainer figures of a generation batch, in the order of `importance_ratio`'s stats
_DEFERRED_FIGURES = ("sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max",
                     "sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/mean",
                     "sampling/importance_sampling_ratio/max")


@dataclass(frozen=True)
class ScoringSettings:
    """How the trainer scores tokens: eviback's two changes to TRL's passes, and their sizes."""

    padding_free: bool = True  # rows at their real lengths, only scored tokens through a chunked LM head
    defer_old_pass: bool = True  # the importance ratio from the loss pass, without TRL's extra old pass
    chunk_tokens: int = 512  # positions per LM-head tile: (512, vocab) fp32 is 100 MB for SmolLM2
    token_budget: int = 16384  # tokens per right-padded decoder batch (update.length_buckets)
    max_padding: float = 0.2  # padding share a batch may carry (0: every row alone)

    def __post_init__(self) -> None:
        check_fields(self)
        for name in ("chunk_tokens", "token_budget"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.max_padding <= 1.0:
            raise ValueError(f"max_padding must be in [0, 1] (a share of a batch's tokens), got {self.max_padding}")

    @classmethod
    def trl(cls) -> ScoringSettings:
        """TRL's own passes, unchanged."""
        return cls(padding_free=False, defer_old_pass=False)


@dataclass
class ScoringState:
    """What the scoring passes of one generation batch hand to each other between TRL's calls."""

    skip_old_pass: bool = False  # TRL's coming no-grad old pass is deferred to the loss passes
    rollout_masks: list[list[int]] | None = None  # the rollout's tool masks, for the no-grad passes
    first_loss_pass: bool = True  # the batch's first micro-batch has not been scored yet
    loss_mask: torch.Tensor | None = None  # (B, C) loss mask of the micro-batch being scored
    deferred_inputs: dict[str, Any] | None = None  # the micro-batch whose importance ratio is still to fill
    deferred_stats: torch.Tensor | None = None  # running engine/trainer figures over the batch's micro-batches


class FastScoring(GRPOTrainer):
    """`GRPOTrainer` with this module's scoring; a trainer lists it among its bases. `scoring` may be replaced
    on an instance; `apply_importance_ratio` False measures the engine/trainer difference but weights every
    token by 1 (the behaviour correction switched off)."""

    scoring: ScoringSettings = ScoringSettings()
    apply_importance_ratio: bool = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._scoring_state = ScoringState()
        super().__init__(*args, **kwargs)

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        state = self._scoring_state = ScoringState(skip_old_pass=self._can_defer_old_logps())
        deferring = state.skip_old_pass
        output = super()._generate_and_score_completions(inputs)
        # deferred: TRL asked for the old pass and got the placeholder
        deferred, state.skip_old_pass = deferring and not state.skip_old_pass, False
        if deferred:
            # Drop the placeholder, so that TRL's loss takes `per_token_logps.detach()` as the old log-probs;
            # `deferred_is` tells the loss pass to fill in the importance ratio.
            output.pop("old_per_token_logps", None)
            output["deferred_is"] = torch.ones(output["completion_ids"].shape[0], dtype=torch.bool,
                                               device=output["completion_ids"].device)
        return output

    def _generate(self, prompts: list) -> tuple:
        output = super()._generate(prompts)
        self._scoring_state.rollout_masks = output[2]  # per row: 1 model token, 0 observation (None: no env_mask)
        return output

    def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> torch.Tensor:
        state = self._scoring_state
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        if state.first_loss_pass:
            # After the rollouts, the teacher and the reference pass: give their freed heap back before the
            # update allocates (without it the process's RSS grows from step to step).
            release_free_heap()
        state.loss_mask, state.rollout_masks, state.first_loss_pass = mask, None, False
        deferred = inputs.pop("deferred_is", None) is not None
        state.deferred_inputs = inputs if deferred else None
        try:
            return super()._compute_loss(model, inputs)
        finally:
            state.loss_mask = state.deferred_inputs = None

    def _get_per_token_logps_and_entropies(self, model: Any, input_ids: torch.Tensor,
                                           attention_mask: torch.Tensor, logits_to_keep: int,
                                           batch_size: int | None = None, compute_entropy: bool = False,
                                           compute_aux_loss: bool = False, **extra: Any) -> tuple:
        state = self._scoring_state
        if (state.skip_old_pass and model is self.model and not torch.is_grad_enabled()
                and adapters_enabled(self.accelerator.unwrap_model(model))):
            # TRL's no-grad old pass after the rollouts: deferred to the loss passes. (Under LoRA, TRL's reference
            # pass runs this same model with its adapter disabled: never the old pass.)
            state.skip_old_pass = False
            placeholder = torch.full(input_ids.shape[:1] + (logits_to_keep,), float("nan"), device=input_ids.device)
            return placeholder, None, None
        logps, entropy, aux = self._per_token_logps(model, input_ids, attention_mask, logits_to_keep, batch_size,
                                                    compute_entropy, compute_aux_loss, **extra)
        if state.deferred_inputs is not None and torch.is_grad_enabled():
            inputs, state.deferred_inputs = state.deferred_inputs, None
            self._fill_importance_ratio(inputs, logps.detach())
        return logps, entropy, aux

    # ---- padding-free scoring

    def _per_token_logps(self, model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                         logits_to_keep: int, batch_size: int | None, compute_entropy: bool,
                         compute_aux_loss: bool, **extra: Any) -> tuple:
        plan = None
        if self._padding_free_applies(model, compute_entropy, compute_aux_loss, extra):
            plan = score_plan(attention_mask, logits_to_keep, self._score_mask(attention_mask, logits_to_keep))
        if plan is None:
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **extra)
        settings = self.scoring
        logits_dtype = torch.float32 if self.args.cast_lm_head_to_fp32 else None
        inner = self.accelerator.unwrap_model(model)

        def score() -> tuple[torch.Tensor, torch.Tensor]:
            out = padding_free_logprobs(causal_lm(inner), input_ids, plan, temperature=self.temperature,
                                        chunk_tokens=settings.chunk_tokens, logits_dtype=logits_dtype,
                                        token_budget=settings.token_budget, max_padding=settings.max_padding)
            return out.logps, out.entropy

        with self.accelerator.autocast():
            # under DDP through its wrapper, whose forward prepares the gradients' all-reduce
            logps, entropy = score() if inner is model else call_through_wrapper(model, inner, score)
        return logps, (entropy if compute_entropy else None), None

    def _padding_free_applies(self, model: Any, compute_entropy: bool, compute_aux_loss: bool,
                              extra: dict[str, Any]) -> bool:
        """The padding-free path covers text-only causal LMs with a plain LM head, bare or in a DDP wrapper
        (several processes: it computes through the wrapper, :func:`call_through_wrapper`), LoRA's PeftModel
        included, when the entropy needs no gradient; anything else (DeepSpeed's engine, a compiled model) goes to
        TRL's path. Under PEFT the rows go through the transformers model inside the PeftModel (`get_base_model()`,
        not `PeftModel.base_model`, which is PEFT's LoraModel): its LoRA layers are in place, so the decoder
        computes with the adapter, and without it inside `disable_adapter()` (TRL's reference pass); the LM head
        carries no adapter (TRL refuses one there)."""
        if not self.scoring.padding_free or compute_aux_loss or any(v is not None for v in extra.values()):
            return False
        if compute_entropy and getattr(self, "_entropy_bonus_enabled", False):
            return False  # the entropy bonus backpropagates through the entropy
        inner = self.accelerator.unwrap_model(model)
        if inner is not model and not isinstance(model, torch.nn.parallel.DistributedDataParallel):
            return False
        model = causal_lm(inner)
        config = model.config.get_text_config()
        if any(getattr(config, name, None) is not None for name in
               ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier",
                "logits_scaling")):
            return False
        head = model.get_output_embeddings()
        return head is not None and getattr(head, "bias", None) is None

    def _score_mask(self, attention_mask: torch.Tensor, logits_to_keep: int) -> torch.Tensor | None:
        """(B, C) positions to score: the loss mask inside `_compute_loss`; in the no-grad passes after a
        rollout, its tool masks when they match the batch; otherwise None (every completion token)."""
        state = self._scoring_state
        batch = attention_mask.shape[0]
        if state.loss_mask is not None:
            return state.loss_mask if tuple(state.loss_mask.shape) == (batch, logits_to_keep) else None
        masks = state.rollout_masks
        if masks is None or len(masks) != batch:
            return None
        # built on the host (the plan reads it there: update.score_plan), one row at a time
        out = torch.zeros(batch, logits_to_keep, dtype=torch.long, device="cpu")
        real = attention_mask[:, -logits_to_keep:].sum(dim=1).tolist()
        for b, (row, n) in enumerate(zip(masks, real, strict=True)):
            if n and len(row) != n:
                return None  # not this rollout's batch
            out[b, :len(row)] = torch.tensor(row[:logits_to_keep], dtype=torch.long, device="cpu")
        return out  # the plan reads it on the host

    # ---- the deferred importance ratio

    def _can_defer_old_logps(self) -> bool:
        """Whether the old pass can be the loss pass's: one optimiser step per generation batch, so the weights
        the old pass would see are the loss pass's. LoRA changes nothing here: the adapter, like full weights,
        moves only at the optimiser step; TRL's reference pass through the same PeftModel (adapter disabled)
        is told apart from the old pass (:func:`eviback.train.lora.adapters_enabled`) and computed as usual."""
        return bool(self.scoring.defer_old_pass and self.use_vllm and self.vllm_importance_sampling_correction
                    and self.num_iterations == 1
                    and self.args.gradient_accumulation_steps % self.args.steps_per_generation == 0)

    def _fill_importance_ratio(self, inputs: dict[str, Any], old: torch.Tensor) -> None:
        """Fill in the micro-batch's importance ratio from its loss pass's log-probs `old` (detached) and
        update the batch's logged engine/trainer differences."""
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        ratio, stats = importance_ratio(old, inputs["sampling_per_token_logps"], mask,
                                        mode=self.vllm_importance_sampling_mode,
                                        cap=self.vllm_importance_sampling_clip_max)
        inputs["importance_sampling_ratio"] = ratio if self.apply_importance_ratio else torch.ones_like(ratio)
        # Running figures over the batch's micro-batches and processes (every process scores the same number
        # of micro-batches, so the gather is a matched collective).
        stats = self.accelerator.gather(stats.to(old.device)).view(-1, stats.numel()).cpu()
        state = self._scoring_state
        total = state.deferred_stats
        for row in stats:
            total = row.clone() if total is None else torch.stack([
                total[0] + row[0], total[1] + row[1], torch.maximum(total[2], row[2]),
                torch.minimum(total[3], row[3]), total[4] + row[4], total[5] + row[5],
                torch.maximum(total[6], row[6])])
        state.deferred_stats = total
        delta_sum, delta_n, delta_max, ratio_min, ratio_sum, ratio_n, ratio_max = total.tolist()
        values = (delta_sum / delta_n if delta_n else 0.0, delta_max if delta_n else 0.0,
                  ratio_min if ratio_n else 0.0, ratio_sum / ratio_n if ratio_n else 0.0,
                  ratio_max if ratio_n else 0.0)
        metrics = self._metrics["train"]
        for name, value in zip(_DEFERRED_FIGURES, values, strict=True):
            if metrics.get(name):
                metrics[name][-1] = value  # TRL logged a placeholder for this generation batch
            else:
                metrics[name].append(value)

    def drop_deferred_figures(self) -> None:
        """Remove TRL's placeholders of the engine/trainer figures of this generation batch: for a batch no
        loss pass scores (nothing was kept), there is nothing to report."""
        metrics = self._metrics["train"]
        for name in _DEFERRED_FIGURES:
            if metrics.get(name):
                metrics[name].pop()

