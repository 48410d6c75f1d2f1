"""The configuration of an `eviback train` run: one dataclass, presets, files and overrides.

A run's configuration is resolved in this order, later wins: the dataclass defaults, a preset
(`eviback`, `grpo`, `dapo`, `f1-fallback`, `eviback-single-prompt`, ...: YAML files next to this module
holding values only), a user YAML file (`--config`), then `--set key=value` overrides. Every value is checked
against its field's type where it is read (`eviback.settings`): `--set lam=abc` is refused with a message
naming the setting and the type it takes. The resolved configuration is written to the run directory as
`config.yaml`; a resumed run must match it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from eviback import dtype as dtypes
from eviback.backoff import BackoffConfig, Mode
from eviback.settings import check_fields, check_settings, field_types, parse_setting_value

PRESETS_PACKAGE = "eviback.train"


@dataclass
class TrainConfig:
    """Every setting of a GRPO / EviBack training run. Defaults follow Search-R1 where they apply."""

    # ---- model and data
    model: str = field(default="smollm2-135m", metadata={"help": "policy: a built-in name, a local HF model "
                       "directory, or a cached hub name"})
    warm_start: bool = field(default=True, metadata={"help": "fine-tune the model on protocol trajectories first "
                             "(`eviback sft`, cached); SmolLM2 never searches without it"})
    warm_start_examples: int = field(default=200, metadata={"help": "warm-start training examples"})
    data: str | None = field(default=None, metadata={"help": "data suite directory (default: the embedded one)"})
    train_files: list[str] = field(default_factory=list, metadata={"help": "QA files to train on (default: the "
                                   "suite's training files)"})
    retriever: str | None = field(default=None, metadata={"help": "index directory or /retrieve URL (default: "
                                  "BM25 over the suite's corpus)"})
    # ---- rollouts
    backend: str = field(default="vllm", metadata={"help": "generation engine: vllm or hf"})
    group_size: int = field(default=5, metadata={"help": "G, rollouts per question (Search-R1: 5)"})
    questions_per_step: int = field(default=4, metadata={"help": "questions per optimisation step"})
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature (Search-R1: 1.0)"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling"})
    max_turns: int = field(default=2, metadata={"help": "searches allowed before the final no-search turn"})
    max_turn_tokens: int = field(default=500, metadata={"help": "tokens generated per turn (Search-R1: 500)"})
    max_obs_tokens: int = field(default=500, metadata={"help": "tokens of retrieved text per search"})
    topk: int = field(default=3, metadata={"help": "passages per search (Search-R1: 3)"})
    # ---- the algorithm
    mode: str = field(default="eviback", metadata={"help": "grpo, dapo, eviback, or f1-fallback (all-zero groups "
                      "get the actor's own token F1 as reward, no teacher)"})
    lam: float = field(default=0.1, metadata={"help": "lambda: scale of fallback advantages (teacher or F1), after "
                       "normalisation"})
    adv_eps: float = field(default=1e-6, metadata={"help": "epsilon added to the group std"})
    teacher: str = field(default="two-stage", metadata={"help": "teacher policy: a built-in name "
                         "(two-stage, single-prompt-dual-task) or a frozen policy file"})
    teacher_backend: str = field(default="local", metadata={"help": "local (in-process model) or http "
                                 "(an OpenAI-compatible endpoint)"})
    teacher_model: str = field(default="smollm2-135m", metadata={"help": "the teacher's model: a local model for "
                               "the local backend, the served model name for http"})
    teacher_url: str | None = field(default=None, metadata={"help": "base URL of the OpenAI-compatible server"})
    teacher_concurrency: int = field(default=8, metadata={"help": "concurrent teacher requests"})
    allow_leaky_teacher: bool = field(default=False, metadata={"help": "accept a teacher policy whose status stage "
                                      "sees the gold answers (the single-prompt baseline); refused otherwise"})
    # ---- optimisation (TRL GRPOTrainer)
    learning_rate: float = field(default=1e-6, metadata={"help": "Search-R1: 1e-6"})
    max_grad_norm: float = field(default=1.0, metadata={"help": "gradient clipping (on the fp32 gradients); 0: off"})
    is_correction: bool = field(default=True, metadata={"help": "truncated importance sampling against the "
                                "generation engine's sampled log-probs (behaviour-policy correction)"})
    is_cap: float = field(default=2.0, metadata={"help": "upper bound of the importance ratio"})
    is_level: str = field(default="token", metadata={"help": "importance ratio per token or per sequence"})
    beta: float = field(default=0.001, metadata={"help": "KL coefficient (k3 estimator); Search-R1: 0.001"})
    loss_type: str = field(default="dapo", metadata={"help": "TRL's loss aggregation (not the baseline mode): "
                           "dapo = token mean over the batch (Search-R1/verl's token-mean), grpo, bnpo, dr_grpo"})
    max_steps: int = field(default=20, metadata={"help": "optimisation steps"})
    save_steps: int = field(default=5, metadata={"help": "checkpoint every N steps (resume point)"})
    save_total_limit: int = field(default=2, metadata={"help": "checkpoints kept"})
    micro_batch_rows: int = field(default=0, metadata={"help": "rollouts per forward/backward pass of the update "
                                  "(0: 1 on CPU, one group of G on GPU); fewer rows, less activation memory, same "
                                  "loss and gradient; must divide questions_per_step x group_size"})
    gradient_checkpointing: bool = field(default=False, metadata={"help": "recompute activations in the backward "
                                         "pass: saves memory on large models, costs ~30% time"})
    dtype: str = field(default="auto", metadata={"help": "compute dtype of the trainer, its rollout engine and "
                       "the local teacher: auto (bf16 where the device computes it natively, fp32 otherwise; "
                       "decided by a cached matmul measurement, recorded in dtype.json), bfloat16 (CPU: a bf16 "
                       "model with fp32 master weights; GPU: fp32 weights under accelerate's bf16 autocast) or "
                       "float32"})
    seed: int = field(default=0, metadata={"help": "seed for sampling and data order"})
    build_seed: int = field(default=0, metadata={"help": "seed of the cached warm start and evidence judge the run "
                            "starts from; apart from `seed`, so that runs of several seeds share one starting point"})
    report_to: list[str] = field(default_factory=list, metadata={"help": "extra logging integrations of "
                                 "transformers (tensorboard, wandb, ...); metrics.jsonl is always written"})
    # ---- evaluation after training
    eval_benchmarks: list[str] = field(default_factory=list, metadata={"help": "benchmarks to evaluate on after "
                                       "training (held-out files of the suite); empty: none"})
    eval_limit: int = field(default=50, metadata={"help": "questions per benchmark in the final evaluation"})
    eval_warm_start: bool = field(default=True, metadata={"help": "evaluate the starting policy on the same "
                                  "questions too, for the before/after table"})
    # ---- what the run directory keeps
    keep_rollout_steps: int = field(default=10, metadata={"help": "full rollouts (texts, passages) are kept for "
                                    "the last N steps in rollouts/; groups.jsonl keeps a compact line per group"})
    # ---- the trained evidence judge (Stage A of a local teacher)
    teacher_stage_a: str = field(default="judge", metadata={"help": "with a local teacher and the two-stage "
                                 "policy: 'judge' decides Stage A with the trained evidence judge (`eviback "
                                 "build-judge`, built from the training questions on first use, then cached); "
                                 "'prompted' keeps the policy's prompted Stage A on the local model"})
    judge_max_questions: int = field(default=0, metadata={"help": "training questions the evidence judge is "
                                     "built from (0: all)"})
    judge_epochs: float = field(default=2.0, metadata={"help": "training passes of the evidence judge"})
    teacher_stage_b: str = field(default="extractive", metadata={"help": "with a local teacher and the two-stage "
                                 "policy: 'extractive' answers Stage B with the span of the evidence the actor saw "
                                 "that best matches the gold (no model: the two-stage-extractive policy); "
                                 "'prompted' keeps the policy's LLM Stage B on the local model. A served (http) "
                                 "teacher keeps its LLM Stage B"})
    teacher_span_words: int = field(default=0, metadata={"help": "the longest span, in words, an extractive Stage "
                                    "B may answer (0: the policy's own bound, 8 in the built-ins)"})

    def __post_init__(self) -> None:
        check_fields(self)  # types first: the checks below compare numbers
        Mode(self.mode)  # raises with the valid names
        if self.backend not in ("vllm", "hf"):
            raise ValueError(f"backend must be 'vllm' or 'hf', got {self.backend!r}")
        if self.teacher_backend not in ("local", "http"):
            raise ValueError(f"teacher_backend must be 'local' or 'http', got {self.teacher_backend!r}")
        if self.teacher_stage_b not in ("extractive", "prompted"):
            raise ValueError(f"teacher_stage_b must be 'extractive' or 'prompted', got {self.teacher_stage_b!r}")
        if self.teacher_span_words < 0:
            raise ValueError(f"teacher_span_words must be >= 0 (0: the policy's own bound), got "
                             f"{self.teacher_span_words}")
        if self.teacher_backend == "http" and not self.teacher_url:
            raise ValueError("teacher_backend=http needs teacher_url (e.g. http://127.0.0.1:8000/v1)")
        if self.group_size < 2:
            raise ValueError(f"group_size must be >= 2 for group-relative advantages, got {self.group_size}")
        for name in ("questions_per_step", "max_steps", "save_steps", "max_turn_tokens", "topk"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_turns < 0:
            raise ValueError(f"max_turns must be >= 0, got {self.max_turns}")
        if self.is_level not in ("token", "sequence"):
            raise ValueError(f"is_level must be token or sequence, got {self.is_level!r}")
        if self.is_cap <= 0:
            raise ValueError(f"is_cap must be > 0, got {self.is_cap}")
        if self.keep_rollout_steps < 0:
            raise ValueError(f"keep_rollout_steps must be >= 0, got {self.keep_rollout_steps}")
        rollouts = self.questions_per_step * self.group_size
        if self.micro_batch_rows < 0 or (self.micro_batch_rows and rollouts % self.micro_batch_rows):
            raise ValueError(f"micro_batch_rows={self.micro_batch_rows} must divide questions_per_step x group_size "
                             f"= {rollouts} (0: 1 on CPU, one group on a GPU)")
        dtypes.check(self.dtype, allowed=("bfloat16", "float32"))

    @property
    def backoff(self) -> BackoffConfig:
        return BackoffConfig(mode=Mode(self.mode), lam=self.lam, eps=self.adv_eps)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def preset_names() -> list[str]:
    folder = resources.files(PRESETS_PACKAGE) / "presets"
    return sorted(p.name.removesuffix(".yaml") for p in folder.iterdir() if p.name.endswith(".yaml"))


def load_preset(name: str) -> dict[str, Any]:
    path = resources.files(PRESETS_PACKAGE) / "presets" / f"{name}.yaml"
    if not path.is_file():
        raise ValueError(f"unknown preset {name!r}; presets: {', '.join(preset_names())}")
    return yaml.safe_load(path.read_text()) or {}


def _field_types() -> dict[str, Any]:
    return field_types(TrainConfig)


def parse_override(text: str) -> tuple[str, Any]:
    """`key=value` with the value parsed as YAML (so `lam=0.5`, `eval_benchmarks=[nq,popqa]` work) and checked
    against the setting's type (:func:`eviback.settings.parse_setting_value`); raises ValueError naming the
    setting and the type it takes."""
    if "=" not in text:
        raise ValueError(f"override {text!r} is not key=value")
    key, value = text.split("=", 1)
    key = key.strip().replace("-", "_")
    if key not in _field_types():
        raise ValueError(f"unknown setting {key!r}; see `eviback train --help-config`")
    return key, parse_setting_value(key, value, _field_types()[key])


def resolve_config(
    preset: str | None = None, config_file: str | Path | None = None, overrides: list[str] | None = None
) -> TrainConfig:
    values: dict[str, Any] = {}
    if preset:
        values.update(check_settings(TrainConfig, load_preset(preset), f"preset {preset!r}"))
    if config_file:
        loaded = yaml.safe_load(Path(config_file).read_text()) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"{config_file}: expected a mapping of settings")
        values.update(check_settings(TrainConfig, loaded, str(config_file)))
    for item in overrides or []:
        key, value = parse_override(item)
        values[key] = value
    unknown = sorted(set(values) - set(_field_types()))
    if unknown:
        raise ValueError(f"unknown setting(s) {unknown}; see `eviback train --help-config`")
    return TrainConfig(**values)


def describe_fields() -> str:
    """One line per setting with its default and help (for `--help-config`)."""
    lines = []
    for f in dataclasses.fields(TrainConfig):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        lines.append(f"  {f.name:22s} {default!r:>16}  {f.metadata.get('help', '')}")
    return "\n".join(lines)
