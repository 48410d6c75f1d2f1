"""The constraint spec of an E2E-APE run: what a teacher workflow must satisfy, then what to optimise.

Constraints come first (EVIBACK.md section 5): hard gates, stability gates judged on confidence bounds, a cost
budget, and only then the objective among the candidates that pass them; the data split and the search
budget complete the spec. The spec is a YAML file holding values only (the default is ``default.yaml`` next
to this module; `eviback ape --write-spec FILE` copies it for editing); the dataclasses below define every
field, its help text and its validation::

    spec = load_spec("my-spec.yaml")      # or load_spec() for the default
    spec.stability.reordered_evidence.min_agreement

Unknown keys are refused (a typo never silently falls back to a default), and every error names the fix.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from eviback.settings import check_setting
from eviback.types import from_dict, to_dict

SPEC_SCHEMA_VERSION = 1
DEFAULT_SPEC = "default.yaml"


class SpecError(ValueError):
    """The constraint spec is malformed. The message names the field and the fix."""


def _help(text: str, **kwargs: Any) -> Any:
    return field(metadata={"help": text}, **kwargs)


@dataclass(frozen=True)
class HardGates:
    """Constraints a candidate must meet exactly; one failure rejects it."""

    max_stage_a_gold_requests: int = _help(
        "requests to the status-deciding stage that carry the gold answers: found statically in the workflow, "
        "or by canary strings planted in the gold answers during evaluation. The evidence boundary: must be 0",
        default=0)
    max_overturned_i: int = _help("verdicts whose Stage A status was I but whose final status is not: must be 0",
                                  default=0)
    max_schema_violation_rate: float = _help(
        "share of judged rollouts with a reply that did not fit the stage's output schema", default=0.02)
    max_error_rate: float = _help("share of judged rollouts that ended as teacher_error (after retries)",
                                  default=0.02)

    def __post_init__(self) -> None:
        if self.max_stage_a_gold_requests != 0:
            raise SpecError("hard_gates.max_stage_a_gold_requests must be 0: gold reaching the status decision "
                            "is reference leakage, the one thing the teacher exists to prevent")
        if self.max_overturned_i != 0:
            raise SpecError("hard_gates.max_overturned_i must be 0: an I verdict is final (the evidence boundary)")
        for name in ("max_schema_violation_rate", "max_error_rate"):
            if not 0 <= getattr(self, name) <= 1:
                raise SpecError(f"hard_gates.{name}={getattr(self, name)} must be in [0, 1]")


@dataclass(frozen=True)
class StabilityCheck:
    """One stability gate: the verdict must not change under a perturbation that should not matter."""

    enabled: bool = _help("measure and gate this check", default=True)
    min_agreement: float = _help(
        "the Wilson lower bound of the agreement rate (share of rollouts whose verdicts all agree) must reach "
        "this", default=0.8)
    min_kappa: float | None = _help(
        "the bootstrap lower bound of Fleiss' kappa (chance-corrected agreement) must reach this; null: "
        "reported, not gated", default=0.4)

    def __post_init__(self) -> None:
        if not 0 <= self.min_agreement <= 1:
            raise SpecError(f"min_agreement={self.min_agreement} must be in [0, 1]")
        if self.min_kappa is not None and not -1 <= self.min_kappa <= 1:
            raise SpecError(f"min_kappa={self.min_kappa} must be in [-1, 1] (or null to not gate kappa)")


class ConstantTeacher(enum.StrEnum):
    """What a gate does with a kappa that is undefined because every verdict had the same label."""

    FAIL = "fail"  # a constant teacher carries no information: reject it
    PASS = "pass"  # only the agreement rate gates it


@dataclass(frozen=True)
class Stability:
    """Stability gates, each judged on a confidence bound over a deterministic subset of rollouts."""

    confidence: float = _help("one-sided confidence of every bound (Wilson, bootstrap)", default=0.95)
    rollouts: int = _help("rollouts of the split that the stability checks and the canary audit use (a "
                          "deterministic subset; all when the split is smaller)", default=40)
    samples: int = _help("teacher samples per rollout for the repeated-sampling check (the first is the base "
                         "verdict)", default=3)
    bootstrap_resamples: int = _help("bootstrap resamples for the kappa lower bound", default=1000)
    constant_teacher: ConstantTeacher = _help(
        "when kappa is undefined because all verdicts share one label: fail (default) or pass",
        default=ConstantTeacher.FAIL)
    repeated_sampling: StabilityCheck = _help("same verdict for teacher samples 0..samples-1",
                                              default_factory=StabilityCheck)
    reordered_evidence: StabilityCheck = _help("same verdict with the retrieved passages in another order "
                                               "(rollouts with fewer than 2 passages are not counted)",
                                               default_factory=StabilityCheck)
    paraphrased_question: StabilityCheck = _help("same verdict with the question reworded",
                                                 default_factory=StabilityCheck)

    def __post_init__(self) -> None:
        object.__setattr__(self, "constant_teacher", ConstantTeacher(self.constant_teacher))
        if not 0.5 <= self.confidence < 1:
            raise SpecError(f"stability.confidence={self.confidence} must be in [0.5, 1), e.g. 0.95")
        if self.rollouts < 2:
            raise SpecError(f"stability.rollouts={self.rollouts} must be >= 2")
        if self.samples < 2 and self.repeated_sampling.enabled:
            raise SpecError("stability.samples must be >= 2 for the repeated-sampling check; or set "
                            "stability.repeated_sampling.enabled: false")
        if self.bootstrap_resamples < 100:
            raise SpecError(f"stability.bootstrap_resamples={self.bootstrap_resamples} is too few for a lower "
                            f"bound; use >= 100 (1000 is the default)")

    def checks(self) -> dict[str, StabilityCheck]:
        return {"repeated_sampling": self.repeated_sampling, "reordered_evidence": self.reordered_evidence,
                "paraphrased_question": self.paraphrased_question}


@dataclass(frozen=True)
class CostBudget:
    """Expected cost of judging one rollout (Stage B is counted only on the rollouts where it runs)."""

    max_tokens_per_rollout: float = _help("mean prompt + completion tokens per judged rollout", default=4000.0)
    max_calls_per_rollout: float = _help("mean stage requests per judged rollout", default=2.0)

    def __post_init__(self) -> None:
        if self.max_tokens_per_rollout <= 0 or self.max_calls_per_rollout <= 0:
            raise SpecError("cost.max_tokens_per_rollout and cost.max_calls_per_rollout must be > 0")


class ObjectiveMetric(enum.StrEnum):
    BALANCED_AGREEMENT = "sufficiency_balanced_agreement"  # mean of the per-label agreements (S on
    # sufficient evidence, I on insufficient): a constant teacher scores 0.5 whatever the label balance
    AGREEMENT = "sufficiency_agreement"  # plain share of agreement with the label


@dataclass(frozen=True)
class Objective:
    """What the feasible candidates are ranked by: agreement with the evidence-sufficiency labels.

    A rollout's label is objective where the question's gold passages are known (metadata.gold_passage_ids):
    sufficient when the actor's retrieved evidence contains all of them."""

    metric: ObjectiveMetric = _help("sufficiency_balanced_agreement or sufficiency_agreement",
                                    default=ObjectiveMetric.BALANCED_AGREEMENT)
    ambiguous_credit: float = _help("credit of an A verdict against either label (S or I earns 1 when right)",
                                    default=0.5)
    tie_tolerance: float = _help("objective values closer than this are a tie, which the cheaper candidate "
                                 "(fewer tokens per rollout) wins", default=0.0)
    min_labelled: int = _help("labelled validation rollouts needed to rank candidates", default=10)

    def __post_init__(self) -> None:
        object.__setattr__(self, "metric", ObjectiveMetric(self.metric))
        if not 0 <= self.ambiguous_credit <= 1:
            raise SpecError(f"objective.ambiguous_credit={self.ambiguous_credit} must be in [0, 1]")
        if self.tie_tolerance < 0:
            raise SpecError(f"objective.tie_tolerance={self.tie_tolerance} must be >= 0")


@dataclass(frozen=True)
class DataSplit:
    """The deterministic split of the rollouts by question (a hash of the question id and the salt)."""

    train: float = _help("share of questions whose rollouts feed the controller (failures shown to it)",
                         default=0.5)
    validation: float = _help("share used to gate and rank candidates", default=0.25)
    test: float = _help("share sealed until a winner is selected, then read once for the final comparison",
                        default=0.25)
    salt: str = _help("salt of the split hash: another salt is another split", default="eviback-ape-v1")
    feedback_rollouts: int = _help("training rollouts judged per parent to find failures to show the "
                                   "controller", default=24)
    all_zero_only: bool = _help("keep only rollouts of questions none of whose rollouts in the dumps is a "
                                "verified hit (EM 1): the all-zero groups the teacher is for", default=False)
    balance_labels: bool = _help("unless all_zero_only: keep every rollout of the all-zero groups, then add "
                                 "rollouts of other questions (in a fixed hashed order) only while their "
                                 "evidence label (S or I) is the rarer one so far", default=True)
    paraphrases: str = _help("optional JSONL of {id, paraphrase} question rewordings for the paraphrase check; "
                             "questions without one get a rule-based rewording", default="")

    def __post_init__(self) -> None:
        shares = (self.train, self.validation, self.test)
        if any(s <= 0 for s in shares) or abs(sum(shares) - 1) > 1e-9:
            raise SpecError(f"data shares train/validation/test = {shares} must be > 0 and sum to 1")
        if self.feedback_rollouts < 1:
            raise SpecError("data.feedback_rollouts must be >= 1")


@dataclass(frozen=True)
class Search:
    """Which candidates are proposed and how many are evaluated."""

    seeds: tuple[str, ...] = _help("built-in (or frozen) policies to start from; the first boundary-compliant "
                                   "one is the base the structural variants are derived from",
                                   default=("two-stage", "single-prompt-dual-task"))
    mutations: tuple[str, ...] = _help("systematic structural variants applied to the base in round 0 and to "
                                       "the current parent later (names from eviback.ape.candidates); "
                                       "['all'] for every one", default=("all",))
    rounds: int = _help("controller rounds after round 0", default=3)
    proposals_per_round: int = _help("controller proposals per round (each a sampled reply)", default=2)
    mutations_per_round: int = _help("systematic variants of the parent added per controller round, so the "
                                     "search moves even when the controller's proposals are unusable",
                                     default=1)
    acceptance: str = _help("which new candidates proceed to validation: 'always', or "
                            "'improves-on-feedback' (GEPA's rule: not worse than the parent on the training "
                            "feedback rollouts)", default="always")
    max_candidates: int = _help("candidates (valid proposals) at most, seeds included", default=16)
    max_stages: int = _help("stages a candidate may have (1: single prompt, 2: gated two-stage)", default=2)
    failures_shown: int = _help("training failures shown to the controller per proposal", default=3)
    controller_temperature: float = _help("sampling temperature of the controller", default=0.8)
    controller_max_tokens: int = _help("completion budget of one controller reply", default=700)
    seed: int = _help("seed of the controller's sampling, of sampled variants and of the bootstrap", default=0)

    def __post_init__(self) -> None:
        object.__setattr__(self, "seeds", tuple(self.seeds))
        object.__setattr__(self, "mutations", tuple(self.mutations))
        if not self.seeds:
            raise SpecError("search.seeds is empty; list at least one policy, e.g. [two-stage]")
        for name in ("rounds", "proposals_per_round", "mutations_per_round"):
            if getattr(self, name) < 0:
                raise SpecError(f"search.{name} must be >= 0")
        if self.max_candidates < 1 or self.max_stages < 1 or self.controller_max_tokens < 1:
            raise SpecError("search.max_candidates, max_stages and controller_max_tokens must be >= 1")


class FreezeRule(enum.StrEnum):
    LOWER_BOUND_ABOVE_BASELINE = "lower-bound-above-baseline"  # the winner's objective lower bound on the
    # sealed test is above the manual single-prompt policy's point estimate there


@dataclass(frozen=True)
class Freeze:
    """When the selected winner is frozen: only when the sealed test confirms it. Otherwise the run ends with
    nothing frozen and the reasons."""

    rule: FreezeRule = _help("lower-bound-above-baseline: the winner's bootstrap lower bound of the objective on "
                             "the sealed test (stability.confidence, stability.bootstrap_resamples) must exceed "
                             "the single-prompt baseline's point estimate there",
                             default=FreezeRule.LOWER_BOUND_ABOVE_BASELINE)
    margin: float = _help("the lower bound must exceed the baseline by more than this", default=0.0)
    require_test_gates: bool = _help("every gate must also hold for the winner on the sealed test", default=True)

    def __post_init__(self) -> None:
        object.__setattr__(self, "rule", FreezeRule(self.rule))
        if not 0 <= self.margin < 1:
            raise SpecError(f"freeze.margin={self.margin} must be in [0, 1)")


@dataclass(frozen=True)
class ConstraintSpec:
    """An E2E-APE run's constraints, objective, data split and search budget."""

    schema_version: int = _help("version of this format", default=SPEC_SCHEMA_VERSION)
    hard_gates: HardGates = _help("exact constraints", default_factory=HardGates)
    stability: Stability = _help("stability gates on confidence bounds", default_factory=Stability)
    cost: CostBudget = _help("the cost budget", default_factory=CostBudget)
    objective: Objective = _help("the ranking among feasible candidates", default_factory=Objective)
    data: DataSplit = _help("the split of the rollouts", default_factory=DataSplit)
    search: Search = _help("the candidate search", default_factory=Search)
    freeze: Freeze = _help("when the winner is frozen (the sealed-test rule)", default_factory=Freeze)

    def __post_init__(self) -> None:
        if self.schema_version != SPEC_SCHEMA_VERSION:
            raise SpecError(f"spec schema_version {self.schema_version} is not supported (this eviback reads "
                            f"{SPEC_SCHEMA_VERSION}); start from `eviback ape --write-spec FILE`")

    def canonical_json(self) -> str:
        return json.dumps(to_dict(self), sort_keys=True, separators=(",", ":"), ensure_ascii=False)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.canonical_json().encode("utf-8")).hexdigest()


def _check_keys(cls: type, data: Any, where: str) -> dict[str, Any]:
    """`data` with its values typed: refuse keys that are not fields (from_dict would ignore them, and a typo
    would go unnoticed) and values not of their field's type (`min_agreement: high` would fail later, in a
    comparison, without naming the field); convert as `eviback.settings` does (`1e-3` is a number)."""
    if not isinstance(data, dict):
        raise SpecError(f"{where}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise SpecError(f"{where}: unknown key(s) {unknown}; valid keys: {sorted(names)}")
    out = dict(data)
    for key, value in data.items():
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            if value is not None:
                out[key] = _check_keys(tp, value, f"{where}.{key}")
            continue
        try:
            out[key] = check_setting(key, value, tp)
        except ValueError as e:
            raise SpecError(f"{where}.{key}: {e}") from None
    return out


def spec_from_mapping(data: Any, where: str = "spec") -> ConstraintSpec:
    data = _check_keys(ConstraintSpec, data or {}, where)
    try:
        return from_dict(ConstraintSpec, data)
    except SpecError as e:
        raise SpecError(f"{where}: {e}") from None
    except (TypeError, ValueError) as e:
        raise SpecError(f"{where}: {e}") from None


def default_spec_text() -> str:
    return (resources.files("eviback.ape") / DEFAULT_SPEC).read_text(encoding="utf-8")


def load_spec(path: str | Path | None = None) -> ConstraintSpec:
    """The spec in the YAML file at `path` (default: the packaged default spec)."""
    if path is None:
        return spec_from_mapping(yaml.safe_load(default_spec_text()), f"default spec ({DEFAULT_SPEC})")
    text = Path(path).read_text(encoding="utf-8")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise SpecError(f"{path}: not valid YAML: {e}") from None
    return spec_from_mapping(data, str(path))


def spec_yaml(spec: ConstraintSpec) -> str:
    """The spec as YAML values (what a run writes next to its outputs)."""
    return yaml.safe_dump(to_dict(spec), sort_keys=False, allow_unicode=True)
