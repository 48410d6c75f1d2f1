"""GRPO with evidence-constrained teacher backoff, as an adapter on TRL's `GRPOTrainer` (trl==1.16.0).

    eviback train --preset eviback --output runs/eviback        # or: grpo, dapo, f1-fallback, eviback-oracle, ...

What TRL does here, and what eviback does:

- TRL owns the optimisation: data order, the clipped policy loss with the KL term (k3, `beta`), gradient
  accumulation, the optimiser and schedule, checkpoints, logging integrations and multi-process launches
  (`accelerate launch -m eviback.cli train ...`).
- eviback owns the rollouts and the advantages (this module). TRL's `rollout_func` hook runs
  :class:`RolloutEngine` (whole groups at once) and computes each group's advantages with the pure functions
  of :mod:`eviback.backoff` (actor rewards for groups with a verified hit; the teacher's hybrid rewards, or
  with `f1-fallback` the actor's own token F1, x lambda for all-zero groups);
  :meth:`EviBackTrainer._generate_and_score_completions` puts them in place of TRL's.
- Retrieved tokens never reach the loss: the engine's `TokenTrace.mask` goes to TRL as `env_mask`, which TRL
  multiplies into the loss mask (KL included).
- Before each rollout step the policy's weights are pushed into the generation engine, so rollouts are
  on-policy up to the engines' numerics; that remaining mismatch is corrected by truncated importance sampling
  against the engine's sampled log-probs (:class:`~eviback.train.config.BehaviourCorrection`, through TRL's own
  vLLM correction path).
- A step that keeps no group (DAPO drops every group of the step, on every process) runs no update: no
  reference pass, no loss pass, no gradient, so the optimiser leaves the weights and its moments as they were.
- Several processes: each rolls out and judges its own whole groups; the step's records are gathered and
  the main process alone calls `on_step`.

Two other concerns live in their own units, both TRL overrides: :mod:`eviback.train.scoring` (padding-free
log-probs and the deferred importance ratio) and :mod:`eviback.train.masters` (fp32 master weights and
checkpoints). The step's records are :mod:`eviback.train.step_records`.

TRL 1.16 facts this module relies on (checked against its source; the version is pinned):
`rollout_func(prompts, trainer)` receives each prompt of the process's generation batch repeated
`num_generations` times in a row (whole groups, as the repeat sampler lays them out) and must return one
completion per row; extra keys of its result reach the reward functions as keyword arguments;
`_generate_and_score_completions` returns the process's rows in rollout order with an `advantages` tensor of
shape (rows,) which the loss reads later.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from accelerate.utils import gather_object
from datasets import Dataset

from eviback.backoff import BackoffConfig, GroupAdvantages, Mode, group_advantages, needs_teacher
from eviback.generation.base import push_weights, sleep_backend, staged_parameters, wake_backend
from eviback.metrics import exact_match, f1_score
from eviback.protocol import build_prompt
from eviback.rollout import RolloutBatch, RolloutEngine
from eviback.train.config import BehaviourCorrection
from eviback.train.lora import engine_weights
from eviback.train.masters import MasterWeights
from eviback.train.scoring import FastScoring
from eviback.train.step_records import StepOutcome, merge_outcomes
from eviback.types import Group, Question, StopReason, Verdict

JudgeGroups = Callable[[Sequence[Group]], list[tuple[Verdict, ...]]]


def em_reward(completions: list, em: list[float], **_: Any) -> list[float]:
    """TRL's reward function: the actor's EM, computed by the rollout (it reads the model's own text)."""
    return [float(e) for e in em]


class _EngineSync:
    """What TRL's vLLM path calls before each rollout (`sync_weights`): our weight push into our engine."""

    def __init__(self, trainer: EviBackTrainer) -> None:
        self.trainer = trainer

    def sync_weights(self) -> None:
        self.trainer._sync_weights()


@dataclass
class StepState:
    """What one generation batch hands between TRL's calls: its questions (set before TRL generates), and the
    rollouts and their advantages (set by the rollout function)."""

    questions: list[Question]
    batch: RolloutBatch | None = None
    outcomes: tuple[GroupAdvantages, ...] = ()
    verdicts: tuple[tuple[Verdict, ...] | None, ...] = ()
    teacher_s: float = 0.0
    sync_s: float = 0.0
    update_skipped: bool = False  # no group was kept on any process: no update this step


class EviBackTrainer(FastScoring, MasterWeights):
    """GRPOTrainer whose rollouts come from eviback's engine and whose advantages come from
    :mod:`eviback.backoff`.

    Args:
        engine: the rollout engine (its backend generates; weights are pushed each step).
        questions: the training questions by id (the dataset rows carry only the id and the prompt).
        backoff: the advantage mode (grpo, dapo, eviback, f1-fallback) and lambda.
        judge_groups: the teacher, called once per step with every all-zero group (None: no teacher).
        on_step: called with each step's :class:`StepOutcome` (the run logs it).
        push_weights: push the policy into the engine before each rollout (False when the engine runs
            the trainer's own model).
        master: the fp32 master copy when training runs in bf16 with fp32 masters (:mod:`eviback.train.masters`).
        rollout_seed: base seed of the rollouts (each step and process gets its own).
        correction: the behaviour-policy correction (truncated importance sampling).
    """

    def __init__(
        self,
        *,
        engine: RolloutEngine,
        questions: dict[str, Question],
        backoff: BackoffConfig,
        judge_groups: JudgeGroups | None,
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
        self.rollout_seed = rollout_seed
        self.correction = correction or BehaviourCorrection()
        self._generation = StepState(questions=[])
        self._weights_step: int | None = None
        super().__init__(master=master, rollout_func=self._rollout, reward_funcs=[em_reward], **kwargs)
        # One group size: the engine's is the run's (an engine-less trainer, in tests, only scores).
        if engine is not None and engine.config.group_size != self.num_generations:
            raise ValueError(f"the rollout engine samples groups of {engine.config.group_size} but TRL's "
                             f"num_generations is {self.num_generations}; build both from one group_size")
        # Behaviour-policy correction through TRL's own vLLM path: with `use_vllm` set, TRL computes the
        # trainer's log-probs of the sampled tokens, compares them with the engine's (the rollout's `logprobs`),
        # logs the difference and multiplies the per-token loss by the truncated importance ratio. The engine
        # is ours, so TRL's weight sync is pointed at our push (`_EngineSync`), called before each rollout.
        self.use_vllm = True
        self.vllm_generation = _EngineSync(self)
        self._last_loaded_step = -1
        self.vllm_importance_sampling_correction = True  # measured always; applied when the correction is on
        self.vllm_importance_sampling_mode = self.correction.mode
        self.vllm_importance_sampling_clip_max = self.correction.cap
        self.vllm_importance_sampling_clip_min = None
        self.apply_importance_ratio = self.correction.enabled

    # ---- rollouts and advantages

    def _sync_weights(self) -> None:
        """Push the policy into the generation engine once per optimiser step (on-policy rollouts)."""
        # a vLLM engine whose weights were discarded by its sleep (level 2) is owed a push even within a step
        discarded = getattr(self.engine.backend, "weights_discarded", False)
        if not self.push_weights or (self._weights_step == self.state.global_step and not discarded):
            return
        t0 = time.perf_counter()
        model = engine_weights(self.accelerator.unwrap_model(self.model))  # LoRA: the merged weights
        # a policy server shared by every process is pushed by the main process, the others waiting for it
        push_weights(self.engine.backend, model, self.accelerator)
        self._weights_step = self.state.global_step
        self._generation.sync_s = time.perf_counter() - t0

    def push_policy(self) -> None:
        """Push the policy as it is now (the step just trained) into this process's engine, at once and by this
        process alone: no barrier, so the main process may call it while the others wait elsewhere (validation,
        :mod:`eviback.train.validation`), a policy server every process shares included."""
        if not self.push_weights:
            return
        model = engine_weights(self.accelerator.unwrap_model(self.model))  # LoRA: the merged weights
        self.engine.backend.update_weights(staged_parameters(model))
        # The engine now holds this step's weights: the next rollout need not push them again, unless every
        # process must take part in that push (a shared server's, with its barrier) or a sleep discards them.
        if not getattr(self.engine.backend, "shared", False) or self.accelerator.num_processes == 1:
            self._weights_step = self.state.global_step

    def _rollout(self, prompts: list, trainer: Any) -> dict[str, list]:
        """TRL's rollout function: the step's groups rolled out, judged and given their advantages."""
        step = self._generation
        if len(prompts) != len(step.questions) * self.num_generations:
            raise RuntimeError(f"TRL passed {len(prompts)} prompts for {len(step.questions)} groups of "
                               f"{self.num_generations}; this adapter is written for trl==1.16.0")
        self._sync_weights()  # TRL has called it through `_EngineSync` already; this is a no-op then
        wake_backend(self.engine.backend)  # vLLM on a GPU: its KV cache back (a no-op elsewhere)
        seed = self.rollout_seed * 1_000_003 + self.state.global_step * 97 + self.accelerator.process_index
        step.batch = batch = self.engine.rollout(step.questions, seed=seed)  # groups of the engine's group_size
        # vLLM on a GPU: its memory back to the trainer before the reference pass and the update need it
        sleep_backend(self.engine.backend)
        self._advantages(batch)
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

    def _advantages(self, batch: RolloutBatch) -> None:
        """Each group's advantages: actor EM, the teacher for the all-zero groups (one call for all of them,
        judged concurrently), the actor's F1 for f1-fallback; and whether the step keeps any group at all."""
        step = self._generation
        t0 = time.perf_counter()
        em = [[exact_match(t.answer, t.question.golden_answers) for t in g.trajectories] for g in batch.groups]
        asking = [i for i, g_em in enumerate(em) if needs_teacher(g_em, self.backoff)]
        verdicts: list[tuple[Verdict, ...] | None] = [None] * len(em)
        if asking and self.judge_groups is not None:
            for i, judged in zip(asking, self.judge_groups([batch.groups[i] for i in asking]), strict=True):
                verdicts[i] = judged
        step.teacher_s = time.perf_counter() - t0
        f1 = [[f1_score(t.answer, t.question.golden_answers) for t in g.trajectories] for g in batch.groups]
        step.outcomes = tuple(group_advantages(g_em, v, self.backoff, f1=g_f1)
                              for g_em, v, g_f1 in zip(em, verdicts, f1, strict=True))
        step.verdicts = tuple(verdicts)
        # Whether any process keeps a group: a collective, so that every process skips the update together.
        kept = torch.tensor([sum(o.keep for o in step.outcomes)], device=self.accelerator.device)
        step.update_skipped = int(self.accelerator.gather(kept).sum().item()) == 0

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        group_size = self.num_generations
        ids = [x["question_id"] for x in inputs]
        starts = range(0, len(ids), group_size)
        if len(ids) % group_size or any(len(set(ids[i:i + group_size])) != 1 for i in starts):
            raise RuntimeError("the generation batch does not hold whole groups in a row; "
                               "this adapter is written for trl==1.16.0")
        step = self._generation = StepState(questions=[self.questions_by_id[ids[i]] for i in starts])
        output = super()._generate_and_score_completions(inputs)
        batch = step.batch
        if batch is None or len(batch.groups) != len(step.questions):
            raise RuntimeError("TRL did not call the rollout function for this batch")
        device = output["advantages"].device
        output["advantages"] = torch.tensor([a for o in step.outcomes for a in o.advantages],
                                            dtype=torch.float32, device=device)
        if self.backoff.mode is Mode.DAPO:
            self._drop_groups(output)
        if not self.correction.enabled and "importance_sampling_ratio" in output and "deferred_is" not in output:
            # Measured (the log-prob difference is logged) but not applied: every ratio is 1.
            output["importance_sampling_ratio"] = torch.ones_like(output["importance_sampling_ratio"])
        self._fix_clipped_ratio(batch)
        if step.update_skipped:
            self.drop_deferred_figures()  # no loss pass: TRL's engine/trainer figures were never computed
        outcome = StepOutcome(self.state.global_step + 1, batch, step.outcomes, step.verdicts, step.teacher_s,
                              step.sync_s, update_skipped=step.update_skipped)
        if self.accelerator.num_processes > 1:
            # One record per step for the whole run: every process's groups, logged by the main process.
            outcome = merge_outcomes(gather_object([outcome]))
        if self.accelerator.is_main_process:
            self.on_step(outcome)
        return output

    def _drop_groups(self, output: dict[str, Any]) -> None:
        """DAPO-style filtering: a dropped group leaves the loss and its token count (attention is kept). The
        token count is a collective: every process takes part, whether it dropped a group or not."""
        group_size = self.num_generations
        dropped = [r for i, o in enumerate(self._generation.outcomes) if not o.keep
                   for r in range(i * group_size, (i + 1) * group_size)]
        mask = output.get("tool_mask")
        if mask is None:
            mask = output["tool_mask"] = torch.ones_like(output["completion_mask"])
        if dropped:
            mask[dropped] = 0
        tokens = (output["completion_mask"] * mask).sum()
        output["num_items_in_batch"] = self.accelerator.gather(tokens).sum()

    def _fix_clipped_ratio(self, batch: RolloutBatch) -> None:
        """TRL counts a completion as clipped when it does not end with EOS; a trajectory ends on a stop
        string (`</answer>`) or a forced stop, so its figure read about 1.0. Replace it with the share of
        trajectories cut by the token budget (stop reason LENGTH), across processes."""
        values = self._metrics["train"].get("completions/clipped_ratio")
        if not values:
            return
        # on the process's device: NCCL gathers only CUDA tensors
        cut = torch.tensor([float(t.stop_reason is StopReason.LENGTH) for t in batch.trajectories],
                           device=self.accelerator.device)
        values[-1] = self.accelerator.gather(cut).mean().item()

    # ---- a step that keeps no group: no update

    def _get_per_token_logps_and_entropies(self, model: Any, input_ids: torch.Tensor,
                                           attention_mask: torch.Tensor, logits_to_keep: int,
                                           batch_size: int | None = None, compute_entropy: bool = False,
                                           compute_aux_loss: bool = False, **extra: Any) -> tuple:
        if self._generation.update_skipped and not torch.is_grad_enabled():
            # TRL's reference and old passes of a step without update: nothing will read them.
            return torch.zeros(input_ids.shape[:1] + (logits_to_keep,), device=input_ids.device), None, None
        return super()._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
            compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **extra)

    def compute_loss(self, model: Any, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> torch.Tensor:
        if self._generation.update_skipped:
            # No forward pass and no gradient: the optimiser skips every parameter without a gradient, so the
            # weights and AdamW's moments stay bit-identical; the learning-rate schedule still counts the step.
            return torch.zeros((), device=self.accelerator.device, requires_grad=True)
        return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                    num_items_in_batch=num_items_in_batch)


def training_dataset(questions: Sequence[Question]) -> Dataset:
    """TRL's dataset: the Search-R1 prompt (what TRL logs) and the question id (what the adapter reads)."""
    return Dataset.from_list([{"prompt": build_prompt(q.question), "question_id": q.id} for q in questions])
