"""GRPO with evidence-constrained teacher backoff, as an adapter on TRL's `GRPOTrainer` (trl==1.16.0).

    eviback train --preset eviback --output runs/eviback        # or: grpo, dapo, f1-fallback, eviback-oracle, ...

What TRL does here, and what eviback does:

- TRL owns the optimisation: data order, the clipped policy loss with the KL term (k3, `beta`), gradient
  accumulation, the optimiser and schedule, checkpoints, logging integrations and multi-process launches
  (`accelerate launch -m eviback.cli train ...`).
- eviback owns the rollouts and the advantages. TRL's `rollout_func` hook runs :class:`RolloutEngine` (whole
  groups at once, on the vLLM engine by default), and :meth:`EviBackTrainer._generate_and_score_completions`
  replaces the advantages TRL computed with those of the pure functions in :mod:`eviback.backoff` (actor
  rewards for groups with a verified hit; the teacher's hybrid rewards, or with `f1-fallback` the actor's own
  token F1, x lambda for all-zero groups).
- Retrieved tokens never reach the loss: the engine's `TokenTrace.mask` goes to TRL as `env_mask`, which TRL
  multiplies into the loss mask (KL included).
- Before each rollout step the policy's weights are pushed into the vLLM engine (`update_weights`: the
  worker's `reload_weights`; TRL 1.16's own vLLM sync fails on CPU), so rollouts are on-policy up to the
  engines' numerics; that remaining mismatch is corrected by truncated importance sampling against the
  engine's sampled log-probs (:class:`BehaviourCorrection`, through TRL's own vLLM correction path).
- In bf16 on CPU, each micro-batch's gradients are summed in fp32 on the master weights.
- Several processes: each rolls out and judges its own whole groups; the step's records are gathered and
  the main process alone calls `on_step`.

TRL 1.16 facts this module relies on (checked against its source; the version is pinned):
`rollout_func(prompts, trainer)` receives each prompt of the process's generation batch repeated
`num_generations` times in a row (whole groups, as the repeat sampler lays them out) and must return one
completion per row; extra keys of its result reach the reward functions as keyword arguments;
`_generate_and_score_completions` returns the process's rows in rollout order with an `advantages` tensor of
shape (rows,) which the loss reads later.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from trl import GRPOTrainer

from eviback.backoff import (
    BackoffConfig,
    GroupAdvantages,
    GroupKind,
    Mode,
    group_advantages,
    has_verified_hit,
    needs_teacher,
    summarize,
)
from eviback.generation.base import sleep_backend, wake_backend
from eviback.metrics import exact_match, f1_score
from eviback.protocol import build_prompt
from eviback.rollout import RolloutBatch, RolloutEngine
from eviback.train.diversity import diversity_metrics, group_diversity
from eviback.train.precision import MasterWeightAdamW
from eviback.types import Group, Question, Status, StopReason, Verdict, to_dict

log = logging.getLogger(__name__)

MASTER_WEIGHTS = "master.safetensors"  # the fp32 master weights inside a checkpoint (bf16 training)


def em_reward(completions: list, em: list[float], **_: Any) -> list[float]:
    """TRL's reward function: the actor's EM, computed by the rollout (it reads the model's own text)."""
    return [float(e) for e in em]


@dataclass(frozen=True)
class BehaviourCorrection:
    """Truncated importance sampling for rollouts sampled by another engine than the trainer.

    The rollouts come from the generation engine (vLLM in bf16, or a second HF copy), whose numerics
    differ from the trainer's forward pass; without a correction TRL takes the trainer's own log-probs as
    the behaviour policy (ratio 1). With it, each model token's loss is weighted by
    `min(exp(logp_trainer - logp_engine), cap)` (`token_truncate`, as TRL's vLLM path and verl do), or
    the sequence's product (`sequence_truncate`). `enabled=False` still measures the difference (logged as
    `train/engine_logp_diff_*`) but applies no weight."""

    enabled: bool = True
    cap: float = 2.0
    mode: str = "token_truncate"

    def __post_init__(self) -> None:
        if self.cap <= 0:
            raise ValueError(f"the importance-sampling cap must be > 0, got {self.cap}")
        if self.mode not in ("token_truncate", "sequence_truncate"):
            raise ValueError(f"mode must be token_truncate or sequence_truncate, got {self.mode!r}")


class _EngineSync:
    """What TRL's vLLM path calls before each rollout (`sync_weights`): our weight push into our engine."""

    def __init__(self, trainer: EviBackTrainer) -> None:
        self.trainer = trainer

    def sync_weights(self) -> None:
        self.trainer._sync_weights()


@dataclass(frozen=True)
class StepOutcome:
    """Everything one rollout step produced, for the logs: the groups, their advantages, the verdicts of
    the fallback groups (None where the teacher was not asked), and where the time went."""

    step: int
    batch: RolloutBatch
    outcomes: tuple[GroupAdvantages, ...]
    verdicts: tuple[tuple[Verdict, ...] | None, ...]
    teacher_s: float
    sync_s: float

    @functools.cached_property
    def labels(self) -> tuple[tuple[Status, ...], ...]:
        """The evidence label of every rollout, group by group (S/A/I of what the actor saw, computed from
        the gold by :func:`eviback.teacher.labels.trajectory_label`: a diagnostic, never a reward); computed
        once, for the gate counts, the diversity and the group records."""
        from eviback.teacher.labels import trajectory_label

        return tuple(tuple(trajectory_label(t) for t in g.trajectories) for g in self.batch.groups)


class EviBackTrainer(GRPOTrainer):
    """GRPOTrainer whose rollouts come from eviback's engine and whose advantages come from
    :mod:`eviback.backoff`.

    Args:
        engine: the rollout engine (its backend generates; with vLLM, weights are pushed each step).
        questions: the training questions by id (the dataset rows carry only the id and the prompt).
        backoff: the advantage mode (grpo, dapo, eviback) and lambda.
        judge_groups: the teacher, called once per step with every all-zero group (None: no teacher).
        on_step: called with each step's :class:`StepOutcome` (the run logs it).
        push_weights: push the policy into the engine before each rollout (False when the engine runs
            the trainer's own model, e.g. the HF backend).
        master: the fp32 master copy when training runs in bf16 with
            :class:`~eviback.train.precision.MasterWeightAdamW`; saved in every checkpoint, so a resumed run
            continues from the exact fp32 weights.
        rollout_seed: base seed of the rollouts (each step and process gets its own).
    """

    def __init__(
        self,
        *,
        engine: RolloutEngine,
        questions: dict[str, Question],
        backoff: BackoffConfig,
        judge_groups: Callable[[Sequence[Group]], list[tuple[Verdict, ...]]] | None,
        on_step: Callable[[StepOutcome], None],
        push_weights: bool,
        master: torch.nn.Module | None = None,
        rollout_seed: int = 0,
        correction: BehaviourCorrection | None = None,
        **kwargs: Any,
    ) -> None:
        self.engine = engine
        self.questions_by_id = questions
        self.backoff = backoff
        self.judge_groups = judge_groups
        self.on_step = on_step
        self.push_weights = push_weights
        self.master = master
        self.rollout_seed = rollout_seed
        self._pending: list[Question] = []
        self._batch: RolloutBatch | None = None
        self._sync_s = 0.0
        self._weights_step: int | None = None
        self.correction = correction or BehaviourCorrection()
        super().__init__(rollout_func=self._rollout, reward_funcs=[em_reward], **kwargs)
        # One group size: the engine's is the run's (an engine-less trainer, in tests, only scores).
        if engine is not None and engine.config.group_size != self.num_generations:
            raise ValueError(f"the rollout engine samples groups of {engine.config.group_size} but TRL's "
                             f"num_generations is {self.num_generations}; build both from one group_size")
        # Behaviour-policy correction through TRL's own vLLM path: with `use_vllm` set, TRL computes the
        # trainer's log-probs of the sampled tokens ("old" log-probs, one no-grad forward), compares them
        # with the engine's (the rollout's `logprobs`), logs the difference and multiplies the per-token
        # loss by the truncated importance ratio. The engine is ours, so TRL's weight sync is pointed at
        # our push (`_EngineSync`), which TRL calls before each rollout.
        self.use_vllm = True
        self.vllm_generation = _EngineSync(self)
        self._last_loaded_step = -1
        self.vllm_importance_sampling_correction = True
        self.vllm_importance_sampling_mode = self.correction.mode
        self.vllm_importance_sampling_clip_max = self.correction.cap
        self.vllm_importance_sampling_clip_min = None

    # ---- rollouts

    def _sync_weights(self) -> None:
        """Push the policy into the generation engine once per optimiser step (on-policy rollouts)."""
        # a vLLM engine whose weights were discarded by its sleep (level 2) is owed a push even within a step
        discarded = getattr(self.engine.backend, "weights_discarded", False)
        if not self.push_weights or (self._weights_step == self.state.global_step and not discarded):
            return
        t0 = time.perf_counter()
        model = self.accelerator.unwrap_model(self.model)
        self.engine.backend.update_weights(model.named_parameters())
        self._weights_step = self.state.global_step
        self._sync_s = time.perf_counter() - t0

    def _rollout(self, prompts: list, trainer: Any) -> dict[str, list]:
        group_size = self.num_generations
        if len(prompts) != len(self._pending) * group_size:
            raise RuntimeError(f"TRL passed {len(prompts)} prompts for {len(self._pending)} groups of "
                               f"{group_size}; this adapter is written for trl==1.16.0")
        self._sync_weights()  # TRL has called it through `_EngineSync` already; this is a no-op then
        wake_backend(self.engine.backend)  # vLLM on a GPU: its KV cache back (a no-op elsewhere)
        seed = self.rollout_seed * 1_000_003 + self.state.global_step * 97 + self.accelerator.process_index
        self._batch = batch = self.engine.rollout(self._pending, seed=seed)  # groups of the engine's group_size
        # vLLM on a GPU: its memory back to the trainer before the reference pass and the update need it
        sleep_backend(self.engine.backend)
        rows: dict[str, list] = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "env_mask": [], "em": []}
        for trajectory in batch.trajectories:
            tokens = trajectory.tokens
            if tokens is None:
                raise RuntimeError("the rollout engine must record token traces for training")
            rows["prompt_ids"].append(list(tokens.prompt_ids))
            rows["completion_ids"].append(list(tokens.ids))
            rows["logprobs"].append(list(tokens.logprobs))
            rows["env_mask"].append(list(tokens.mask))
            rows["em"].append(exact_match(trajectory.answer, trajectory.question.golden_answers))
        return rows

    # ---- advantages

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        group_size = self.num_generations
        ids = [x["question_id"] for x in inputs]
        starts = range(0, len(ids), group_size)
        if len(ids) % group_size or any(len(set(ids[i:i + group_size])) != 1 for i in starts):
            raise RuntimeError("the generation batch does not hold whole groups in a row; "
                               "this adapter is written for trl==1.16.0")
        self._pending = [self.questions_by_id[ids[i]] for i in starts]
        self._sync_s = 0.0
        can_defer = self._skip_old_pass = self._can_defer_old_logps()
        try:
            output = super()._generate_and_score_completions(inputs)
        finally:
            # deferred: TRL asked for the old pass and got the placeholder
            deferred, self._skip_old_pass = can_defer and not self._skip_old_pass, False
        if deferred:
            # The old log-probs are the loss pass's own (see `_defer_old_logps`): drop the placeholder, so
            # that TRL's loss takes `per_token_logps.detach()`; the importance ratio is filled in there.
            output.pop("old_per_token_logps", None)
            output["deferred_is"] = torch.ones(output["completion_ids"].shape[0], dtype=torch.bool,
                                               device=output["completion_ids"].device)
            self._deferred_stats = None
        batch = self._batch
        if batch is None or len(batch.groups) != len(self._pending):
            raise RuntimeError("TRL did not call the rollout function for this batch")

        t0 = time.perf_counter()
        em = [[exact_match(t.answer, t.question.golden_answers) for t in g.trajectories] for g in batch.groups]
        asking = [i for i, g_em in enumerate(em) if needs_teacher(g_em, self.backoff)]
        verdicts: list[tuple[Verdict, ...] | None] = [None] * len(em)
        if asking and self.judge_groups is not None:
            # One call for every fallback group of the step: the teacher judges them concurrently.
            for i, judged in zip(asking, self.judge_groups([batch.groups[i] for i in asking]), strict=True):
                verdicts[i] = judged
        teacher_s = time.perf_counter() - t0
        # the actor's own token F1 (no answer: 0): the fallback rewards of the f1-fallback baseline
        f1 = [[f1_score(t.answer, t.question.golden_answers) for t in g.trajectories] for g in batch.groups]
        outcomes = tuple(group_advantages(g_em, v, self.backoff, f1=g_f1)
                         for g_em, v, g_f1 in zip(em, verdicts, f1, strict=True))

        device = output["advantages"].device
        output["advantages"] = torch.tensor([a for o in outcomes for a in o.advantages],
                                            dtype=torch.float32, device=device)
        if self.backoff.mode is Mode.DAPO:
            # DAPO-style filtering: a dropped group leaves the loss and its token count (attention is kept).
            # The token count is a collective: every process takes part, whether it dropped a group or not.
            dropped = [r for i, o in enumerate(outcomes) if not o.keep
                       for r in range(i * group_size, (i + 1) * group_size)]
            mask = output.get("tool_mask")
            if mask is None:
                mask = output["tool_mask"] = torch.ones_like(output["completion_mask"])
            if dropped:
                mask[dropped] = 0
            tokens = (output["completion_mask"] * mask).sum()
            output["num_items_in_batch"] = self.accelerator.gather(tokens).sum()
        if not self.correction.enabled and "importance_sampling_ratio" in output and not deferred:
            # Measured (the log-prob difference is logged) but not applied: every ratio is 1.
            output["importance_sampling_ratio"] = torch.ones_like(output["importance_sampling_ratio"])
        self._fix_clipped_ratio(batch)
        outcome = StepOutcome(self.state.global_step + 1, batch, outcomes, tuple(verdicts), teacher_s, self._sync_s)
        if self.accelerator.num_processes > 1:
            # One record per step for the whole run: every process's groups, logged by the main process.
            from accelerate.utils import gather_object

            outcome = merge_outcomes(gather_object([outcome]))
        if self.accelerator.is_main_process:
            self.on_step(outcome)
        return output

    # ---- the behaviour correction without TRL's extra forward pass
    #
    # With the correction on, TRL runs the policy once more after the rollouts (no grad) for the "old"
    # log-probs: the importance ratio's numerator, and the PPO ratio's denominator. With one optimiser step
    # per generation batch (num_iterations == 1), the weights do not change between that pass and the loss
    # pass of each micro-batch, so both are the loss pass's own log-probs: the old pass is skipped (a NaN
    # placeholder stands in for it), and each micro-batch's importance ratio and the logged engine/trainer
    # differences are computed from its loss pass instead. One forward pass over the whole batch fewer per
    # step; the loss is TRL's (tests/test_train_grpo.py compares the two ways on the same step).

    defer_old_logps: bool = True  # False: TRL's own extra pass
    _skip_old_pass: bool = False
    _deferred_inputs: dict[str, Any] | None = None
    _deferred_stats: torch.Tensor | None = None

    def _can_defer_old_logps(self) -> bool:
        return bool(self.defer_old_logps and self.use_vllm and self.vllm_importance_sampling_correction
                    and self.num_iterations == 1
                    and self.args.gradient_accumulation_steps % self.args.steps_per_generation == 0
                    and not hasattr(self.accelerator.unwrap_model(self.model), "peft_config"))

    def _defer_old_logps(self, inputs: dict[str, Any], old: torch.Tensor) -> None:
        """Fill in the micro-batch's importance ratio from its loss pass's log-probs `old` (detached) and
        update the step's logged engine/trainer differences."""
        from eviback.train.update import importance_ratio

        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        ratio, stats = importance_ratio(old, inputs["sampling_per_token_logps"], mask,
                                        mode=self.vllm_importance_sampling_mode,
                                        cap=self.vllm_importance_sampling_clip_max)
        inputs["importance_sampling_ratio"] = ratio if self.correction.enabled else torch.ones_like(ratio)
        # Running figures over the step's micro-batches and processes (every process scores the same number
        # of micro-batches, so the gather is a matched collective).
        stats = self.accelerator.gather(stats.to(old.device)).view(-1, stats.numel()).cpu()
        total = self._deferred_stats
        for row in stats:
            total = row.clone() if total is None else torch.stack([
                total[0] + row[0], total[1] + row[1], torch.maximum(total[2], row[2]),
                torch.minimum(total[3], row[3]), total[4] + row[4], total[5] + row[5],
                torch.maximum(total[6], row[6])])
        self._deferred_stats = total
        delta_sum, delta_n, delta_max, ratio_min, ratio_sum, ratio_n, ratio_max = total.tolist()
        figures = {"sampling/sampling_logp_difference/mean": delta_sum / delta_n if delta_n else 0.0,
                   "sampling/sampling_logp_difference/max": delta_max if delta_n else 0.0,
                   "sampling/importance_sampling_ratio/min": ratio_min if ratio_n else 0.0,
                   "sampling/importance_sampling_ratio/mean": ratio_sum / ratio_n if ratio_n else 0.0,
                   "sampling/importance_sampling_ratio/max": ratio_max if ratio_n else 0.0}
        metrics = self._metrics["train"]
        for name, value in figures.items():
            if metrics.get(name):
                metrics[name][-1] = value  # TRL logged a placeholder for this generation batch
            else:
                metrics[name].append(value)

    def _fix_clipped_ratio(self, batch: RolloutBatch) -> None:
        """TRL counts a completion as clipped when it does not end with EOS; a trajectory ends on a stop
        string (`</answer>`) or a forced stop, so its figure read about 1.0. Replace it with the share of
        trajectories cut by the token budget (stop reason LENGTH), across processes."""
        values = self._metrics["train"].get("completions/clipped_ratio")
        if not values:
            return
        cut = torch.tensor([float(t.stop_reason is StopReason.LENGTH) for t in batch.trajectories])
        values[-1] = self.accelerator.gather(cut).mean().item()

    # ---- fp32 gradient accumulation (bf16 model, fp32 masters)

    def _master_optimizer(self) -> MasterWeightAdamW | None:
        if self.master is None:
            return None
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)  # accelerate wraps it
        return optimizer if isinstance(optimizer, MasterWeightAdamW) else None

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        loss = super().training_step(model, inputs, num_items_in_batch)
        optimizer = self._master_optimizer()
        if optimizer is not None:
            # Each micro-batch's bf16 gradients go into the fp32 sum at once, so the accumulation over
            # micro-batches never rounds to bf16.
            optimizer.accumulate(reduce_earlier=self.accelerator.sync_gradients)
        return loss

    def _clip_grad_norm(self, model: Any) -> Any:
        optimizer = self._master_optimizer()
        if optimizer is None:
            return super()._clip_grad_norm(model)
        return optimizer.clip_master_grads(self.args.max_grad_norm)

    def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> Any:
        optimizer = self._master_optimizer()
        if optimizer is None or grad_norm is not None:
            return super()._get_grad_norm(model, grad_norm=grad_norm)
        return optimizer.master_grad_norm()

    # ---- checkpoints

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        # The fp32 masters go in first: TRL writes trainer_state.json last, so a checkpoint that looks
        # complete always has them.
        if self.master is not None and self.args.should_save:
            from safetensors.torch import save_model

            folder = os.path.join(self.args.output_dir, f"checkpoint-{self.state.global_step}")
            os.makedirs(folder, exist_ok=True)
            save_model(self.master, os.path.join(folder, MASTER_WEIGHTS))
        super()._save_checkpoint(model, trial)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        # transformers loads a multi-process run's optimizer state with `map_location=args.device`, which on
        # CPU is `cpu:0`, a location torch.load cannot restore to ("don't know how to restore data location
        # ... cpu:0"): an fp32 run of several CPU processes failed to resume (tests/test_train_multiprocess.py
        # with dtype float32, what `auto` picks on a CPU without native bf16). CPU state loads onto "cpu".
        from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME

        optimizer_file = os.path.join(checkpoint or "", OPTIMIZER_NAME)
        scheduler_file = os.path.join(checkpoint or "", SCHEDULER_NAME)
        if (checkpoint is None or self.args.device.type != "cpu" or self.args.world_size <= 1
                or self.is_deepspeed_enabled or self.is_fsdp_enabled
                or not (os.path.isfile(optimizer_file) and os.path.isfile(scheduler_file))):
            return super()._load_optimizer_and_scheduler(checkpoint)
        self.optimizer.load_state_dict(torch.load(optimizer_file, map_location="cpu", weights_only=True))
        self.lr_scheduler.load_state_dict(torch.load(scheduler_file, map_location="cpu", weights_only=True))

    # ---- fast update (eviback.train.update): TRL's log-probability passes without padding
    #
    # TRL scores each micro-batch padded to the generation batch's longest prompt and completion and, on CPU,
    # projects every position (prompts and padding included) onto the vocabulary. These overrides run the
    # rows at their real lengths (similar lengths batched, right-padded) and send only the tokens whose
    # log-probability is read (the model's own tokens: completion mask x tool mask) through a chunked LM head. The loss, the KL term and the
    # importance-sampling ratio are TRL's own, on the same fp32 log-probabilities.

    fast_update: bool = True  # False: TRL's own path (bench_update.py compares the two on the same batch)
    fast_chunk_tokens: int = 512  # positions per LM-head tile: (512, vocab) fp32 is 100 MB for SmolLM2
    fast_token_budget: int = 16384  # tokens per right-padded decoder batch (update.length_buckets)
    fast_max_padding: float = 0.2  # padding share a batch may carry (0: every row alone)
    _fast_rollout_masks: list[list[int]] | None = None  # the rollout's tool masks, for the no-grad passes
    _fast_loss_mask: torch.Tensor | None = None  # (B, C) loss mask of the micro-batch being scored
    _fast_new_batch: bool = False  # a generation batch arrived; its first micro-batch is not scored yet

    def _generate(self, prompts: list) -> tuple:
        output = super()._generate(prompts)
        self._fast_rollout_masks = output[2]  # per row: 1 model token, 0 observation (None without env_mask)
        self._fast_new_batch = True
        return output

    def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> torch.Tensor:
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        if self._fast_new_batch:
            # First micro-batch after the rollouts, the teacher and the reference pass: give their freed heap
            # back before the update allocates (without it the process's RSS grows from step to step).
            from eviback.train.memory import release_free_heap

            release_free_heap()
        self._fast_loss_mask, self._fast_rollout_masks, self._fast_new_batch = mask, None, False
        deferred = inputs.pop("deferred_is", None) is not None
        self._deferred_inputs = inputs if deferred else None
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self._fast_loss_mask = self._deferred_inputs = None

    def _get_per_token_logps_and_entropies(self, model: Any, input_ids: torch.Tensor,
                                           attention_mask: torch.Tensor, logits_to_keep: int,
                                           batch_size: int | None = None, compute_entropy: bool = False,
                                           compute_aux_loss: bool = False, **extra: Any) -> tuple:
        if self._skip_old_pass and model is self.model and not torch.is_grad_enabled():
            # TRL's no-grad "old" pass after the rollouts: deferred to the loss pass (`_defer_old_logps`).
            self._skip_old_pass = False
            return torch.full(input_ids.shape[:1] + (logits_to_keep,), float("nan"), device=input_ids.device), None, None
        logps, entropy, aux = self._per_token_logps(model, input_ids, attention_mask, logits_to_keep, batch_size,
                                                    compute_entropy, compute_aux_loss, **extra)
        if self._deferred_inputs is not None and torch.is_grad_enabled():
            inputs, self._deferred_inputs = self._deferred_inputs, None
            self._defer_old_logps(inputs, logps.detach())
        return logps, entropy, aux

    def _per_token_logps(self, model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                         logits_to_keep: int, batch_size: int | None, compute_entropy: bool,
                         compute_aux_loss: bool, **extra: Any) -> tuple:
        from eviback.train.update import padding_free_logprobs, score_plan

        plan = None
        if self._fast_path_applies(model, compute_entropy, compute_aux_loss, extra):
            plan = score_plan(attention_mask, logits_to_keep, self._fast_score_mask(attention_mask, logits_to_keep))
        if plan is None:
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **extra)
        logits_dtype = torch.float32 if self.args.cast_lm_head_to_fp32 else None
        with self.accelerator.autocast():
            out = padding_free_logprobs(model, input_ids, plan, temperature=self.temperature,
                                        chunk_tokens=self.fast_chunk_tokens, logits_dtype=logits_dtype,
                                        token_budget=self.fast_token_budget, max_padding=self.fast_max_padding)
        return out.logps, (out.entropy if compute_entropy else None), None

    def _fast_path_applies(self, model: Any, compute_entropy: bool, compute_aux_loss: bool,
                           extra: dict[str, Any]) -> bool:
        """The fast path covers text-only causal LMs with a plain LM head, outside PEFT and DDP wrappers, when
        the entropy needs no gradient; anything else goes to TRL's path."""
        if not self.fast_update or compute_aux_loss or any(v is not None for v in extra.values()):
            return False
        if compute_entropy and getattr(self, "_entropy_bonus_enabled", False):
            return False  # the entropy bonus backpropagates through the entropy
        if self.accelerator.unwrap_model(model) is not model or hasattr(model, "peft_config"):
            return False
        config = model.config.get_text_config()
        if any(getattr(config, name, None) is not None for name in
               ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier",
                "logits_scaling")):
            return False
        head = model.get_output_embeddings()
        return head is not None and getattr(head, "bias", None) is None

    def _fast_score_mask(self, attention_mask: torch.Tensor, logits_to_keep: int) -> torch.Tensor | None:
        """(B, C) positions to score: the loss mask inside `_compute_loss`; in the no-grad passes after a
        rollout, its tool masks when they match the batch; otherwise None (every completion token)."""
        batch = attention_mask.shape[0]
        if self._fast_loss_mask is not None:
            return self._fast_loss_mask if tuple(self._fast_loss_mask.shape) == (batch, logits_to_keep) else None
        masks = self._fast_rollout_masks
        if masks is None or len(masks) != batch:
            return None
        out = torch.zeros(batch, logits_to_keep, dtype=torch.long)
        real = attention_mask[:, -logits_to_keep:].sum(dim=1).tolist()
        for b, (row, n) in enumerate(zip(masks, real, strict=True)):
            if n and len(row) != n:
                return None  # not this rollout's batch
            out[b, :len(row)] = torch.tensor(row[:logits_to_keep], dtype=torch.long)
        return out.to(attention_mask.device)


# --------------------------------------------------------------------------------------------------
# Step records


def merge_outcomes(outcomes: Sequence[StepOutcome]) -> StepOutcome:
    """The step of a multi-process run as one record: every process's groups in process order; the
    times are the slowest process's (the step waits for it)."""
    first = outcomes[0]
    if len(outcomes) == 1:
        return first
    batch = RolloutBatch(
        groups=tuple(g for o in outcomes for g in o.batch.groups),
        turns=max((o.batch for o in outcomes), key=lambda b: b.wall_s).turns,
        wall_s=max(o.batch.wall_s for o in outcomes),
    )
    return StepOutcome(
        step=first.step, batch=batch,
        outcomes=tuple(x for o in outcomes for x in o.outcomes),
        verdicts=tuple(v for o in outcomes for v in o.verdicts),
        teacher_s=max(o.teacher_s for o in outcomes),
        sync_s=max(o.sync_s for o in outcomes),
    )


def step_metrics(outcome: StepOutcome, backoff: BackoffConfig) -> dict[str, Any]:
    """The namespaced metrics of one step (rollouts, groups, teacher, time)."""
    batch = outcome.batch
    m = batch.metrics()
    s = summarize(outcome.outcomes, backoff)
    judged = [v for vs in outcome.verdicts if vs for v in vs]
    statuses = [v.status for v in judged if not v.teacher_error]
    record: dict[str, Any] = {
        "step": outcome.step,
        "rollout/em": m.em, "rollout/f1": m.f1, "rollout/sub_em": m.sub_em,
        "rollout/valid_answer_rate": m.valid_answer_rate, "rollout/avg_searches": m.avg_searches,
        "rollout/duplicate_query_rate": m.duplicate_query_rate,
        "rollout/forced_termination_rate": m.forced_termination_rate,
        "rollout/trajectories": m.n, "rollout/generated_tokens": batch.generated_tokens,
        "backoff/groups": s.groups, "backoff/verified_share": s.verified / s.groups if s.groups else 0.0,
        "backoff/all_zero_share": s.all_zero_share, "backoff/fallback_share": s.fallback_share,
        "backoff/fallback_groups": s.fallback, "backoff/informative_fallback_groups": s.informative_fallback,
        "backoff/informative_fallback_share": s.informative_fallback_share,
        "backoff/teacher_error_groups": s.teacher_error,
        "backoff/teacher_error_share": s.teacher_error / s.groups if s.groups else 0.0,
        "backoff/dropped_groups": s.dropped,
        "teacher/judged": len(judged),
        "teacher/calls": sum(v.calls for v in judged),
        "teacher/errors": sum(v.teacher_error for v in judged),
        "teacher/prompt_tokens": sum(v.prompt_tokens for v in judged),
        "teacher/completion_tokens": sum(v.completion_tokens for v in judged),
        "teacher/cache_hits": sum(v.cache_hits for v in judged),
        "teacher/latency_s": sum(v.latency_s for v in judged),
        "teacher/stage_b_runs": sum(v.stage_b_ran for v in judged),
        "teacher/stage_b_ungrounded": sum(v.ungrounded for v in judged),
        "time/rollout": batch.wall_s - batch.retrieve_s,
        "time/retrieval": batch.retrieve_s,
        "time/teacher": outcome.teacher_s,
        "time/weight_sync": outcome.sync_s,
    }
    for status in Status:
        record[f"teacher/status_{status.value}"] = sum(st is status for st in statuses)
    record.update(gate_counts(outcome))
    rewards = [r for o in outcome.outcomes if o.kind is GroupKind.FALLBACK for r in o.rewards]
    record["backoff/fallback_reward_mean"] = sum(rewards) / len(rewards) if rewards else None
    judged_rewards = [r for o, vs in zip(outcome.outcomes, outcome.verdicts, strict=True)
                      if o.kind is GroupKind.FALLBACK and vs for r in o.rewards]
    record["teacher/reward_mean"] = sum(judged_rewards) / len(judged_rewards) if judged_rewards else None
    # could the all-zero groups carry a signal? distinct queries, evidence sets, rewards, statuses per group
    record.update(diversity_metrics([
        group_diversity(g, o.rewards, vs, labels)
        for g, o, vs, labels in zip(batch.groups, outcome.outcomes, outcome.verdicts, outcome.labels, strict=True)
        if not has_verified_hit(o.em, backoff)]))
    return record


def gate_counts(outcome: StepOutcome) -> dict[str, int]:
    """Stage A as a gate, against the evidence labels of the rollouts it judged (computed from the gold; a
    diagnostic, never a reward): `teacher/gate_label_i` rollouts whose evidence is I, of which
    `teacher/gate_closed_on_i` Stage A called I; `teacher/gate_label_open` rollouts whose evidence is S or A,
    of which `teacher/gate_open_on_open` Stage A let through. Summed over a run, the gate's balanced
    accuracy is the mean of the two rates (a step holds too few rollouts for a rate of its own)."""
    counts = {"teacher/gate_label_i": 0, "teacher/gate_closed_on_i": 0, "teacher/gate_label_open": 0,
              "teacher/gate_open_on_open": 0}
    for labels, verdicts in zip(outcome.labels, outcome.verdicts, strict=True):
        for label, v in zip(labels, verdicts or (), strict=False):
            if v.teacher_error or v.stage_a_status is None:
                continue
            closed = v.stage_a_status is Status.INSUFFICIENT
            if label is Status.INSUFFICIENT:
                counts["teacher/gate_label_i"] += 1
                counts["teacher/gate_closed_on_i"] += closed
            else:
                counts["teacher/gate_label_open"] += 1
                counts["teacher/gate_open_on_open"] += not closed
    return counts


def group_records(outcome: StepOutcome) -> list[dict[str, Any]]:
    """One record per group with its whole rollouts (without token ids): EM, verdicts, rewards, advantages,
    how the group was treated. These go to `rollouts/step-<step>.jsonl.gz` (the last few steps only);
    :func:`compact_group_record` of each goes to `groups.jsonl`."""
    records = []
    for group, o, verdicts, labels in zip(outcome.batch.groups, outcome.outcomes, outcome.verdicts, outcome.labels,
                                          strict=True):
        records.append({
            "step": outcome.step,
            "question_id": group.question.id,
            "question": group.question.question,
            "golden_answers": list(group.question.golden_answers),
            "kind": o.kind.value,
            "fallback": o.kind is GroupKind.FALLBACK,
            "em": list(o.em),
            "rewards": list(o.rewards),
            "advantages": list(o.advantages),
            "keep": o.keep,
            "verdicts": [to_dict(v) for v in verdicts] if verdicts else None,
            "labels": [label.value for label in labels],  # the evidence labels (a diagnostic)
            "rollouts": [to_dict(dataclasses.replace(t, tokens=None)) for t in group.trajectories],
        })
    return records


def compact_group_record(record: dict[str, Any]) -> dict[str, Any]:
    """A group record without texts: per rollout its answer, queries, retrieved passage ids and stop
    reason (a few hundred bytes per rollout instead of several kB of passages and model text)."""
    compact = {k: v for k, v in record.items() if k != "rollouts"}
    compact["summaries"] = [{
        "answer": r["answer"],
        "stop_reason": r["stop_reason"],
        "queries": [t["action"]["content"] for t in r["turns"] if t["executed"]],
        "passage_ids": [[p["id"] for p in t["passages"]] for t in r["turns"] if t["executed"]],
        "turns": len(r["turns"]),
    } for r in record["rollouts"]]
    return compact


def training_dataset(questions: Sequence[Question]):  # noqa: ANN201 - a datasets.Dataset
    """TRL's dataset: the Search-R1 prompt (what TRL logs) and the question id (what the adapter reads)."""
    from datasets import Dataset

    return Dataset.from_list([{"prompt": build_prompt(q.question), "question_id": q.id} for q in questions])
