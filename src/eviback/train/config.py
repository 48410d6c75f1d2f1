"""The configuration of an `eviback train` run: one dataclass, presets, files and overrides.

Each setting exists once. The rollout settings are the rollout engine's own config (`config.rollout`, a
:class:`~eviback.rollout.RolloutConfig`), the advantage settings the backoff's (`config.backoff`, a
:class:`~eviback.backoff.BackoffConfig`), the teacher's a :class:`TeacherSettings` (`config.teacher`),
the prompt's a :class:`~eviback.protocol.PromptStyle` (`config.prompt`: `chat_template`, `chat_template_kwargs`);
the engine, TRL's arguments, the advantages and the teacher read those same objects. Settings keep their
flat names wherever they are given (`group_size`, `lam`, `teacher_url`): :data:`SECTION_SETTINGS` says
which field each name sets.

A run's configuration is resolved in this order, later wins: the dataclass defaults, a preset
(`eviback`, `grpo`, `dapo`, `f1-fallback`, `eviback-single-prompt`, ...: YAML files next to this module
holding values only), a user YAML file (`--config`), then `--set key=value` overrides. Every value is checked
against its field's type where it is read (`eviback.settings`): `--set lam=abc` is refused with a message
naming the setting and the type it takes. The resolved configuration is written to the run directory as
`config.yaml`; a resumed run must match it.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from eviback import device as devices
from eviback import dtype as dtypes
from eviback.backoff import BackoffConfig
from eviback.generation import BACKENDS, EngineSettings
from eviback.policy import DEFAULT_MODEL
from eviback.protocol import PromptStyle
from eviback.rollout import RolloutConfig
from eviback.settings import check_fields, check_values, field_types, parse_setting_value
from eviback.teacher import HttpBackendConfig, JudgeConfig, TeacherConfig
from eviback.teacher.local import LocalBackendConfig
from eviback.teacher.openai_http import DEFAULT_BASE_URL
from eviback.train.lora import LoraSettings

PRESETS_PACKAGE = "eviback.train"
# TRL 1.16's loss aggregations (GRPOConfig.loss_type; trl is pinned). TRL itself meets an unknown name only in
# the first loss pass, after the warm start, the engine, the start evaluation and the judge: checked here.
LOSS_TYPES = ("dapo", "grpo", "dr_grpo", "bnpo", "cispo", "sapo", "luspo", "vespo")
# transformers' learning-rate schedules (GRPOConfig.lr_scheduler_type) that need no argument beyond the warm-up
# and the step count; the others need lr_scheduler_kwargs or evaluation metrics, which a run does not pass.
LR_SCHEDULERS = ("constant", "constant_with_warmup", "linear", "cosine", "cosine_with_restarts", "polynomial",
                 "inverse_sqrt")


@dataclass(frozen=True)
class TeacherSettings:
    """The teacher of a training run (EviBack mode): which policy judges, where it runs, and how a local
    two-stage teacher is composed (the trained evidence judge as Stage A, the extractive Stage B)."""

    policy: str = field(default="two-stage", metadata={"help": "teacher policy: a built-in name (two-stage, "
                        "single-prompt-dual-task) or a frozen policy file"})
    backend: str = field(default="local", metadata={"help": "local (in-process model) or http (an OpenAI-compatible "
                         "endpoint)"})
    model: str = field(default="", metadata={"help": "the teacher's model: a local model for the local backend, the "
                       "served model name for http; empty: the backend's own default (the bundled SmolLM2 locally, "
                       "the server's first model over http)"})
    url: str | None = field(default=None, metadata={"help": "base URL of the OpenAI-compatible server (e.g. "
                            f"{DEFAULT_BASE_URL})"})
    concurrency: int = field(default=8, metadata={"help": "concurrent teacher requests"})
    allow_leaky: bool = field(default=False, metadata={"help": "accept a teacher policy whose status stage sees the "
                              "gold answers (the single-prompt baseline); refused otherwise"})
    accept_weak_judge: bool = field(default=False, metadata={"help": "train with a weak evidence judge as Stage A: one "
                                    "whose held-out gate (I vs not-I balanced accuracy on its own held-out training "
                                    "questions) is below 0.6 or was not measured; refused otherwise, before the warm "
                                    "start. teacher.json records that the run accepted it"})
    stage_a: str = field(default="judge", metadata={"help": "with a local teacher and the two-stage policy: 'judge' "
                         "decides Stage A with the trained evidence judge (`eviback build-judge`, built from the "
                         "training questions on first use, then cached); 'prompted' keeps the policy's prompted "
                         "Stage A on the local model"})
    judge_max_questions: int = field(default=0, metadata={"help": "training questions the evidence judge is built "
                                     "from (0: all)"})
    judge_epochs: float = field(default=3.0, metadata={"help": "training passes of a cross-encoder evidence judge "
                                "(a bi-encoder trains no encoder: not used)"})
    judge_architecture: str = field(default="bi-encoder", metadata={"help": "the evidence judge: 'bi-encoder' (the "
                                    "encoder as shipped embeds question and passage apart; a logistic head on their "
                                    "features is trained) or 'cross-encoder' (fine-tuned on the pairs, judge_epochs "
                                    "passes); see docs/teacher.md"})
    judge_base_model: str = field(default="", metadata={"help": "the encoder the evidence judge is fine-tuned from "
                                  "(default: the bundled all-MiniLM-L6-v2); a local model directory"})
    judge_rollouts: list[str] = field(default_factory=list, metadata={"help": "rollout dumps (JSONL, .gz too) of the "
                                      "warm-started actor on training questions that the evidence judge also "
                                      "learns from (benchmarks/bench_teacher_rollouts.py --judge-split train)"})
    stage_b: str = field(default="extractive", metadata={"help": "with a local teacher and the two-stage policy: "
                         "'extractive' answers Stage B with the span of the evidence the actor saw that best matches "
                         "the gold (no model: the two-stage-extractive policy); 'prompted' keeps the policy's LLM "
                         "Stage B on the local model. A served (http) teacher keeps its LLM Stage B"})
    span_words: int = field(default=0, metadata={"help": "the longest span, in words, an extractive Stage B may "
                            "answer (0: the policy's own bound, 8 in the built-ins)"})

    def __post_init__(self) -> None:
        check_fields(self)
        # The messages name the settings as they are set (`teacher_backend`, ...: SECTION_SETTINGS).
        if self.backend not in ("local", "http"):
            raise ValueError(f"teacher_backend must be 'local' or 'http', got {self.backend!r}")
        if self.stage_a not in ("judge", "prompted"):
            raise ValueError(f"teacher_stage_a must be 'judge' or 'prompted', got {self.stage_a!r}")
        if self.stage_b not in ("extractive", "prompted"):
            raise ValueError(f"teacher_stage_b must be 'extractive' or 'prompted', got {self.stage_b!r}")
        if self.judge_architecture not in ("bi-encoder", "cross-encoder"):
            raise ValueError(f"judge_architecture must be 'bi-encoder' or 'cross-encoder', got "
                             f"{self.judge_architecture!r}")
        if self.span_words < 0:
            raise ValueError(f"teacher_span_words must be >= 0 (0: the policy's own bound), got {self.span_words}")
        if self.backend == "http" and not self.url:
            raise ValueError(f"teacher_backend=http needs teacher_url (e.g. {DEFAULT_BASE_URL})")
        if self.concurrency < 1:
            raise ValueError(f"teacher_concurrency must be >= 1, got {self.concurrency}")
        if self.judge_max_questions < 0:
            raise ValueError(f"judge_max_questions must be >= 0 (0: all), got {self.judge_max_questions}")
        if not math.isfinite(self.judge_epochs) or self.judge_epochs <= 0:
            raise ValueError(f"judge_epochs must be a number > 0, got {self.judge_epochs}")

    def teacher_config(self, dtype: str, device: str) -> TeacherConfig:
        """The teacher's own configuration (:class:`~eviback.teacher.TeacherConfig`) for these settings, in the
        run's dtype and on its device; every default not set here is the teacher's own."""
        model = {"model": self.model} if self.model else {}
        return TeacherConfig(
            policy=self.policy, backend=self.backend,
            local=LocalBackendConfig(**model, dtype=dtype, device=device),
            http=HttpBackendConfig(base_url=self.url, **model) if self.url else HttpBackendConfig(),
            judge=JudgeConfig(concurrency=self.concurrency),
        )


@dataclass(frozen=True)
class BehaviourCorrection:
    """Truncated importance sampling for rollouts sampled by another engine than the trainer.

    The rollouts come from the generation engine (vLLM in bf16, or a second HF copy), whose numerics differ
    from the trainer's forward pass; without a correction TRL takes the trainer's own log-probs as the
    behaviour policy (ratio 1). With it, each model token's loss is weighted by
    `min(exp(logp_trainer - logp_engine), cap)` (level `token`, as TRL's vLLM path and verl do), or by the
    sequence's product (`sequence`). `enabled=False` still measures the difference (logged as
    `train/engine_logp_diff_*`) but applies no weight. The trainer takes this section as it is."""

    enabled: bool = field(default=True, metadata={"help": "truncated importance sampling against the generation "
                          "engine's sampled log-probs (behaviour-policy correction); false: measured, not applied"})
    cap: float = field(default=2.0, metadata={"help": "upper bound of the importance ratio"})
    level: str = field(default="token", metadata={"help": "importance ratio per token or per sequence"})

    def __post_init__(self) -> None:
        check_fields(self)
        # The messages name the settings as they are set (`is_cap`, `is_level`: SECTION_SETTINGS).
        if not math.isfinite(self.cap) or self.cap <= 0:
            raise ValueError(f"is_cap must be a number > 0, got {self.cap}")
        if self.level not in ("token", "sequence"):
            raise ValueError(f"is_level must be token or sequence, got {self.level!r}")

    @property
    def mode(self) -> str:
        """TRL's name of the level (`token_truncate`, `sequence_truncate`)."""
        return f"{self.level}_truncate"


# Settings that live in a section of TrainConfig, by the name they are set with (`--set`, presets, YAML
# files, config.yaml) -> (section, field). Every other setting is a field of TrainConfig itself, set by its
# own name. Each field exists once: the rollout engine, TRL's arguments, the advantages and the teacher all
# read the same one.
SECTION_SETTINGS: dict[str, tuple[str, str]] = {
    "group_size": ("rollout", "group_size"),
    "temperature": ("rollout", "temperature"),
    "top_p": ("rollout", "top_p"),
    "max_turns": ("rollout", "max_turns"),
    "max_turn_tokens": ("rollout", "max_turn_tokens"),
    "max_obs_tokens": ("rollout", "max_observation_tokens"),
    "topk": ("rollout", "topk"),
    "mode": ("backoff", "mode"),
    "lam": ("backoff", "lam"),
    "adv_eps": ("backoff", "eps"),
    "teacher": ("teacher", "policy"),
    "teacher_backend": ("teacher", "backend"),
    "teacher_model": ("teacher", "model"),
    "teacher_url": ("teacher", "url"),
    "teacher_concurrency": ("teacher", "concurrency"),
    "allow_leaky_teacher": ("teacher", "allow_leaky"),
    "accept_weak_judge": ("teacher", "accept_weak_judge"),
    "teacher_stage_a": ("teacher", "stage_a"),
    "judge_max_questions": ("teacher", "judge_max_questions"),
    "judge_epochs": ("teacher", "judge_epochs"),
    "judge_architecture": ("teacher", "judge_architecture"),
    "judge_rollouts": ("teacher", "judge_rollouts"),
    "judge_base_model": ("teacher", "judge_base_model"),
    "teacher_stage_b": ("teacher", "stage_b"),
    "teacher_span_words": ("teacher", "span_words"),
    "is_correction": ("correction", "enabled"),
    "is_cap": ("correction", "cap"),
    "is_level": ("correction", "level"),
    "lora_rank": ("lora", "rank"),
    "lora_alpha": ("lora", "alpha"),
    "lora_dropout": ("lora", "dropout"),
    "lora_target_modules": ("lora", "target_modules"),
    "lora_save_merged": ("lora", "save_merged"),
    "policy_url": ("engine", "policy_url"),
    "policy_timeout_s": ("engine", "policy_timeout_s"),
    "gpu_memory_utilization": ("engine", "gpu_memory_utilization"),
    "vllm_sleep_level": ("engine", "sleep_level"),
    "vllm_executor": ("engine", "executor"),
    "chat_template": ("prompt", "chat_template"),
    "chat_template_kwargs": ("prompt", "chat_template_kwargs"),
}
SECTIONS: dict[str, type] = {"rollout": RolloutConfig, "backoff": BackoffConfig, "teacher": TeacherSettings,
                             "correction": BehaviourCorrection, "engine": EngineSettings, "prompt": PromptStyle,
                             "lora": LoraSettings}


def context_tokens(max_turns: int, max_turn_tokens: int, max_observation_tokens: int) -> int:
    """The longest trajectory a run's rollout settings allow (prompt headroom 512): every turn's tokens and
    every observation. The rollout engine caps a trajectory there (or at the backend's limit, if lower)."""
    return max_turn_tokens * (max_turns + 1) + max_observation_tokens * max_turns + 512


@dataclass
class TrainConfig:
    """Every setting of a GRPO / EviBack training run. Defaults follow Search-R1 where they apply.

    The rollout settings are the engine's own :class:`~eviback.rollout.RolloutConfig` (`rollout`), the
    advantage settings :class:`~eviback.backoff.BackoffConfig` (`backoff`), the teacher's
    :class:`TeacherSettings` (`teacher`); each is set by a flat name (`group_size`, `lam`, `teacher_url`:
    :data:`SECTION_SETTINGS`). Build one from settings with :meth:`from_settings`; :meth:`to_dict` gives
    them back by name (what config.yaml holds)."""

    # ---- model and data
    model: str = field(default=DEFAULT_MODEL, metadata={"help": "policy: a built-in name, a local HF model "
                       "directory, or a cached hub name"})
    warm_start: bool = field(default=True, metadata={"help": "fine-tune the model on protocol trajectories first "
                             "(`eviback sft`, cached); SmolLM2 never searches without it"})
    warm_start_examples: int = field(default=200, metadata={"help": "warm-start training examples"})
    data: str | None = field(default=None, metadata={"help": "data suite directory (default: the embedded one)"})
    train_files: list[str] = field(default_factory=list, metadata={"help": "QA files to train on (default: the "
                                   "suite's training files)"})
    retriever: str | None = field(default=None, metadata={"help": "index directory or /retrieve URL (default: "
                                  "BM25 over the suite's corpus)"})
    retrieval_deadline_s: float = field(default=300.0, metadata={"help": "with a /retrieve URL: seconds a search "
                                        "keeps retrying a service that does not answer (stopped, restarting, "
                                        "loading its index) before the run stops and says how to --resume it"})
    # ---- rollouts
    backend: str = field(default="vllm", metadata={"help": "generation engine: vllm (in this process), hf, or "
                         "vllm-server (a `vllm serve` process at policy_url, TRL's server mode: `eviback serve-policy`)"})
    engine: EngineSettings = field(default_factory=EngineSettings)
    questions_per_step: int = field(default=4, metadata={"help": "questions per optimisation step"})
    rollout: RolloutConfig = field(default_factory=lambda: RolloutConfig(max_context_tokens=context_tokens(
        RolloutConfig.max_turns, RolloutConfig.max_turn_tokens, RolloutConfig.max_observation_tokens)))
    # how the prompt reaches the model, in the rollouts, the warm start and the evaluations alike
    prompt: PromptStyle = field(default_factory=PromptStyle)
    # ---- the algorithm
    backoff: BackoffConfig = field(default_factory=BackoffConfig)
    teacher: TeacherSettings = field(default_factory=TeacherSettings)
    # ---- optimisation (TRL GRPOTrainer)
    learning_rate: float = field(default=1e-6, metadata={"help": "Search-R1: 1e-6"})
    lr_scheduler_type: str = field(default="constant", metadata={"help": "learning-rate schedule over max_steps "
                                   "(transformers' names): " + ", ".join(LR_SCHEDULERS) + "; Search-R1: "
                                   "constant_with_warmup"})
    warmup_ratio: float = field(default=0.0, metadata={"help": "share of max_steps over which the learning rate "
                                "rises linearly from 0, in [0, 1): warmup_ratio x max_steps steps, rounded down as "
                                "Search-R1's verl counts them; needs a schedule other than constant; Search-R1: "
                                "0.285"})
    max_grad_norm: float = field(default=1.0, metadata={"help": "gradient clipping (on the fp32 gradients); 0: off"})
    correction: BehaviourCorrection = field(default_factory=BehaviourCorrection)
    lora: LoraSettings = field(default_factory=LoraSettings)  # an adapter instead of every weight (lora_rank > 0)
    beta: float = field(default=0.001, metadata={"help": "KL coefficient (k3 estimator); Search-R1: 0.001"})
    loss_type: str = field(default="dapo", metadata={"help": "TRL's loss aggregation (not the baseline mode): "
                           "dapo = token mean over the batch (Search-R1/verl's token-mean); also " + ", ".join(
                               LOSS_TYPES[1:])})
    max_steps: int = field(default=20, metadata={"help": "optimisation steps"})
    save_steps: int = field(default=5, metadata={"help": "checkpoint every N steps and at the last (resume points); "
                            "0: no checkpoint at all (a run that cannot be resumed; the final policy is still "
                            "saved): a 4B model's checkpoint holds 48 GB of weights and optimiser state"})
    save_total_limit: int = field(default=2, metadata={"help": "checkpoints kept"})
    micro_batch_rows: int = field(default=0, metadata={"help": "rollouts per forward/backward pass of the update "
                                  "(0: 1 on CPU, one group of G on GPU); fewer rows, less activation memory, same "
                                  "loss and gradient; must divide questions_per_step x group_size"})
    gradient_checkpointing: bool | None = field(default=None, metadata={"help": "recompute activations in the "
                                                "backward pass: saves memory on large models, costs ~30% time; "
                                                "None (default): on for models of 1B parameters and more on a GPU"})
    dtype: str = field(default="auto", metadata={"help": "compute dtype of the trainer, its rollout engine and "
                       "the local teacher: auto (bf16 where the device computes it natively, fp32 otherwise; "
                       "decided by a cached matmul measurement, recorded in dtype.json), bfloat16 (CPU: a bf16 "
                       "model with fp32 master weights; GPU: fp32 weights under accelerate's bf16 autocast) or "
                       "float32"})
    device: str = field(default="auto", metadata={"help": devices.HELP + "; every model of the run (trainer, "
                        "reference, engine, teacher, evidence judge, warm start, evaluation) goes there"})
    seed: int = field(default=0, metadata={"help": "seed for sampling and data order"})
    build_seed: int = field(default=0, metadata={"help": "seed of the cached warm start and evidence judge the run "
                            "starts from; apart from `seed`, so that runs of several seeds share one starting point"})
    report_to: list[str] = field(default_factory=list, metadata={"help": "extra logging integrations of "
                                 "transformers (tensorboard, wandb, trackio, ...); each step they get TRL's figures and "
                                 "every figure of metrics.jsonl by its name there (validation included); "
                                 "metrics.jsonl is always written"})
    # ---- evaluation after training
    eval_benchmarks: list[str] = field(default_factory=list, metadata={"help": "benchmarks to evaluate on after "
                                       "training (held-out files of the suite); empty: none"})
    eval_limit: int = field(default=50, metadata={"help": "questions per benchmark in the final evaluation"})
    eval_warm_start: bool = field(default=True, metadata={"help": "evaluate the starting policy on the same "
                                  "questions too, for the before/after table"})
    # ---- validation during training
    val_every: int = field(default=0, metadata={"help": "evaluate held-out questions every N optimisation steps "
                           "(greedy, on the run's own engine with the weights of the step just trained; main process "
                           "only): val/* figures in that step's metrics.jsonl line, val/step-<N>/ with the items; "
                           "0: off"})
    val_benchmarks: list[str] = field(default_factory=list, metadata={"help": "benchmarks of each validation "
                                      "(held-out files of the suite); empty: eval_benchmarks"})
    val_limit: int = field(default=0, metadata={"help": "questions per benchmark in each validation, the first N "
                           "of each file (so the first of the final evaluation's too); 0: eval_limit"})
    # ---- what the run directory keeps
    keep_rollout_steps: int = field(default=10, metadata={"help": "full rollouts (texts, passages) are kept for "
                                    "the last N steps in rollouts/; groups.jsonl keeps a compact line per group"})

    def __post_init__(self) -> None:
        check_fields(self)  # types first: the checks below compare numbers
        for name, section in SECTIONS.items():
            if not isinstance(getattr(self, name), section):
                raise ValueError(f"TrainConfig.{name} must be a {section.__name__}; build a config from settings "
                                 "with TrainConfig.from_settings(...)")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        rollout = self.rollout
        if rollout.group_size < 2:
            raise ValueError(f"group_size must be >= 2 for group-relative advantages, got {rollout.group_size}")
        for name in ("questions_per_step", "max_steps", "save_total_limit", "warm_start_examples", "eval_limit"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("seed", "build_seed"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not math.isfinite(self.learning_rate) or self.learning_rate <= 0:
            raise ValueError(f"learning_rate must be a number > 0, got {self.learning_rate}")
        if self.lr_scheduler_type not in LR_SCHEDULERS:
            raise ValueError(f"lr_scheduler_type must be one of {', '.join(LR_SCHEDULERS)} (transformers' schedules "
                             f"that need no further argument), got {self.lr_scheduler_type!r}")
        if not math.isfinite(self.warmup_ratio) or not 0 <= self.warmup_ratio < 1:
            raise ValueError(f"warmup_ratio must be a number in [0, 1), the share of max_steps the learning rate "
                             f"warms up over (Search-R1: 0.285), got {self.warmup_ratio}")
        if self.warmup_ratio and self.lr_scheduler_type == "constant":
            # transformers' constant schedule ignores the warm-up: said here rather than trained without it
            raise ValueError(f"warmup_ratio={self.warmup_ratio} needs a schedule with a warm-up: set "
                             "lr_scheduler_type=constant_with_warmup (Search-R1's) or another of "
                             f"{', '.join(LR_SCHEDULERS[2:])}, or warmup_ratio=0")
        if not math.isfinite(self.max_grad_norm) or self.max_grad_norm < 0:
            raise ValueError(f"max_grad_norm must be a number >= 0 (0: no clipping), got {self.max_grad_norm}")
        if not math.isfinite(self.beta) or self.beta < 0:
            raise ValueError(f"beta must be a number >= 0 (0: no KL term, no reference model), got {self.beta}")
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {', '.join(LOSS_TYPES)} (TRL's loss aggregations), got "
                             f"{self.loss_type!r}")
        if self.save_steps < 0:
            raise ValueError(f"save_steps must be >= 1 (or 0: no checkpoints), got {self.save_steps}")
        expected = context_tokens(rollout.max_turns, rollout.max_turn_tokens, rollout.max_observation_tokens)
        if rollout.max_context_tokens != expected or not rollout.logprobs:
            raise ValueError(f"the rollout section of a training config bounds the context by its settings "
                             f"({expected} tokens) and records log-probabilities; got max_context_tokens="
                             f"{rollout.max_context_tokens}, logprobs={rollout.logprobs}")
        if self.keep_rollout_steps < 0:
            raise ValueError(f"keep_rollout_steps must be >= 0, got {self.keep_rollout_steps}")
        for name in ("val_every", "val_limit"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0: {'off' if name == 'val_every' else 'eval_limit'}), got "
                                 f"{getattr(self, name)}")
        if self.val_every and not (self.val_benchmarks or self.eval_benchmarks):
            raise ValueError(f"val_every={self.val_every} needs held-out questions: set val_benchmarks (e.g. "
                             "val_benchmarks=[nq]) or eval_benchmarks, or val_every=0")
        if self.retrieval_deadline_s <= 0:
            raise ValueError(f"retrieval_deadline_s must be > 0 (seconds a search waits for the retrieval service; "
                             f"Search-R1's wiki-18 index loads in minutes), got {self.retrieval_deadline_s}")
        rollouts = self.questions_per_step * rollout.group_size
        if self.micro_batch_rows < 0 or (self.micro_batch_rows and rollouts % self.micro_batch_rows):
            raise ValueError(f"micro_batch_rows={self.micro_batch_rows} must divide questions_per_step x group_size "
                             f"= {rollouts} (0: 1 on CPU, one group on a GPU)")
        dtypes.check(self.dtype, allowed=dtypes.TRAINING_DTYPES)
        devices.check_device(self.device)

    @property
    def warmup_steps(self) -> int:
        """Optimisation steps of the learning-rate warm-up: `warmup_ratio x max_steps` rounded down, as verl
        (Search-R1's trainer) counts them (0.285 x 1005 = 286; transformers would round up). The tolerance
        keeps a product that floating point puts just below a whole number (0.29 x 100) on that number."""
        return math.floor(self.warmup_ratio * self.max_steps + 1e-9)

    @classmethod
    def from_settings(cls, values: Mapping[str, Any] | None = None, /, **settings: Any) -> TrainConfig:
        """A config from settings by name (`group_size=3`, `lam=0.5`, `teacher_url=...`, `max_steps=10`):
        each checked against its type (:mod:`eviback.settings`), the rest left at their defaults. Raises
        ValueError naming an unknown setting or one of the wrong type."""
        values = {**(values or {}), **settings}
        unknown = sorted(set(values) - set(setting_types()))
        if unknown:
            raise ValueError(f"unknown setting(s) {unknown}; see `eviback train --help-config`")
        values = check_values(setting_types(), values)
        own = {k: v for k, v in values.items() if k not in SECTION_SETTINGS}
        parts: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
        for key, value in values.items():
            if key in SECTION_SETTINGS:
                section, name = SECTION_SETTINGS[key]
                parts[section][name] = value
        rollout = {**{f.name: f.default for f in dataclasses.fields(RolloutConfig)}, **parts["rollout"]}
        rollout["max_context_tokens"] = context_tokens(rollout["max_turns"], rollout["max_turn_tokens"],
                                                       rollout["max_observation_tokens"])
        return cls(**own, rollout=RolloutConfig(**rollout), backoff=BackoffConfig(**parts["backoff"]),
                   teacher=TeacherSettings(**parts["teacher"]), correction=BehaviourCorrection(**parts["correction"]),
                   engine=EngineSettings(**parts["engine"]), prompt=PromptStyle(**parts["prompt"]),
                   lora=LoraSettings(**parts["lora"]))

    def with_settings(self, **settings: Any) -> TrainConfig:
        """This config with some settings changed (by name, as :meth:`from_settings` takes them)."""
        return type(self).from_settings({**self.to_dict(), **settings})

    def to_dict(self) -> dict[str, Any]:
        """Every setting by name, in plain values (what config.yaml holds, and :meth:`from_settings` takes)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in SECTIONS:
                for key, (section, name) in SECTION_SETTINGS.items():
                    if section == f.name:
                        item = getattr(value, name)
                        out[key] = item.value if isinstance(item, enum.Enum) else item
            else:
                out[f.name] = list(value) if isinstance(value, list) else value
        return out


def preset_names() -> list[str]:
    folder = resources.files(PRESETS_PACKAGE) / "presets"
    return sorted(p.name.removesuffix(".yaml") for p in folder.iterdir() if p.name.endswith(".yaml"))


def load_preset(name: str) -> dict[str, Any]:
    path = resources.files(PRESETS_PACKAGE) / "presets" / f"{name}.yaml"
    if not path.is_file():
        raise ValueError(f"unknown preset {name!r}; presets: {', '.join(preset_names())}")
    return yaml.safe_load(path.read_text()) or {}


def setting_types() -> dict[str, Any]:
    """Every setting by the name it is set with, with its type (a section's setting takes its field's type;
    `mode` takes its name)."""
    return dict(_setting_types())


@functools.cache
def _setting_types() -> dict[str, Any]:
    types = {k: v for k, v in field_types(TrainConfig).items() if k not in SECTIONS}
    for key, (section, name) in SECTION_SETTINGS.items():
        tp = field_types(SECTIONS[section])[name]
        types[key] = str if isinstance(tp, type) and issubclass(tp, enum.Enum) else tp
    return types


def setting_help(name: str) -> tuple[Any, str]:
    """(default, help) of the setting `name`, read from the field that holds it."""
    section, field_name = SECTION_SETTINGS.get(name, (None, name))
    owner = SECTIONS[section] if section else TrainConfig
    f = next(f for f in dataclasses.fields(owner) if f.name == field_name)
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    return (default.value if isinstance(default, enum.Enum) else default), f.metadata.get("help", "")


def parse_override(text: str) -> tuple[str, Any]:
    """`key=value` with the value parsed as YAML (so `lam=0.5`, `eval_benchmarks=[nq,popqa]` work) and checked
    against the setting's type (:func:`eviback.settings.parse_setting_value`); raises ValueError naming the
    setting and the type it takes."""
    if "=" not in text:
        raise ValueError(f"override {text!r} is not key=value")
    key, value = text.split("=", 1)
    key = key.strip().replace("-", "_")
    if key not in setting_types():
        raise ValueError(f"unknown setting {key!r}; see `eviback train --help-config`")
    return key, parse_setting_value(key, value, setting_types()[key])


def resolve_config(
    preset: str | None = None, config_file: str | Path | None = None, overrides: list[str] | None = None
) -> TrainConfig:
    values: dict[str, Any] = {}
    if preset:
        values.update(check_values(setting_types(), load_preset(preset), f"preset {preset!r}"))
    if config_file:
        loaded = yaml.safe_load(Path(config_file).read_text()) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"{config_file}: expected a mapping of settings")
        values.update(check_values(setting_types(), loaded, str(config_file)))
    for item in overrides or []:
        key, value = parse_override(item)
        values[key] = value
    return TrainConfig.from_settings(values)


def describe_fields() -> str:
    """One line per setting with its default and help (for `--help-config`)."""
    lines = []
    for name in TrainConfig().to_dict():
        default, text = setting_help(name)
        lines.append(f"  {name:22s} {default!r:>16}  {text}")
    return "\n".join(lines)
