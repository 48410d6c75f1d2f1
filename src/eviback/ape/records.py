"""The records an E2E-APE run persists: what its event log, its result and a frozen policy's provenance hold.

Frozen dataclasses and enums, each with only the small derived views a reader of the record needs:

- the splits (:class:`Split`, :class:`SplitInfo`);
- candidates (:class:`Origin`, :class:`Candidate`, :class:`RejectedProposal`);
- measurements (:class:`Condition`, :class:`RolloutOutcome`, :class:`ConditionResult`) and the metrics
  computed from them (:class:`CandidateMetrics` and its parts, :class:`RateEstimate`, :class:`KappaEstimate`);
- decisions (:class:`Phase`, :class:`GateResult`, :class:`GateReport`, :class:`Selection`,
  :class:`Confirmation`).

The modules that produce them (``rollouts``, ``candidates``, ``measure``, ``gates``, ``confirm``) import them
from here, and this module imports none of those: editing a gate or a metric leaves the event schema as it
is. It imports only eviback's records (:mod:`eviback.types`, the teacher policy) and two leaves of this
package: the spec's enums a record names, and the Wilson bound a rate estimate is built with.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass

from eviback.ape.spec import FreezeRule, ObjectiveMetric
from eviback.ape.stats import wilson_lower_bound
from eviback.teacher.policy import TeacherPolicy
from eviback.types import Status, Verdict, to_dict

# --------------------------------------------------------------------------------------------------
# Splits


class Split(enum.StrEnum):
    TRAIN = "train"
    VALIDATION = "validation"
    TEST = "test"


@dataclass(frozen=True)
class SplitInfo:
    """What is recorded of a split: sizes, labels and the hash of its exact content."""

    name: Split
    questions: int
    rollouts: int
    labelled: int
    sufficient: int
    sha256: str  # of the sorted rollout keys (which include each trajectory's content hash)


# --------------------------------------------------------------------------------------------------
# Candidates


class Origin(enum.StrEnum):
    SEED = "seed"  # a built-in or frozen policy named in the spec
    MUTATION = "mutation"  # a systematic structural variant of a parent
    CONTROLLER = "controller"  # proposed by the controller LLM


@dataclass(frozen=True)
class Candidate:
    """A candidate teacher workflow and its provenance. `id` is its slot in the search (`s0`, `m3`,
    `r2.p1`, `r2.m0`): slots are deterministic, so a resumed run recognises what it already has."""

    id: str
    policy: TeacherPolicy
    origin: Origin
    parent: str = ""  # the parent candidate's id ("" for seeds)
    round: int = 0
    note: str = ""  # the seed's reference, the mutation's name, or what the controller said it changed

    @property
    def structure(self) -> str:
        return structure_key(self.policy)


@dataclass(frozen=True)
class RejectedProposal:
    """A proposal that never became a candidate (unparseable, invalid): recorded with the reason."""

    id: str
    origin: Origin
    parent: str
    round: int
    reason: str
    excerpt: str = ""  # the start of the raw reply, for the report


def structure_key(policy: TeacherPolicy) -> str:
    """A hash of the workflow without its name and description: two candidates with the same key would
    judge every rollout identically."""
    doc = to_dict(dataclasses.replace(policy, name="", description=""))
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode("utf-8")).hexdigest()


# --------------------------------------------------------------------------------------------------
# Measurements: one rollout judged under one condition


class Condition(enum.StrEnum):
    BASE = "base"  # the rollout as dumped, teacher sample 0
    SAMPLE = "sample"  # teacher sample k >= 1 of the same requests (repeated sampling)
    REORDERED = "reordered"  # the retrieved passages in another order
    PARAPHRASED = "paraphrased"  # the question reworded
    CANARY = "canary"  # canaries planted in the gold answers, every gold-blind request audited
    INJECTED_S = "injected-s"  # an instruction to answer S appended to the first retrieved passage
    INJECTED_I = "injected-i"  # an instruction to answer I appended to the first retrieved passage


@dataclass(frozen=True)
class RolloutOutcome:
    """One rollout judged under one condition: the verdict's essentials and its cost."""

    key: str
    status: Status | None  # final status; None on teacher_error
    stage_a_status: Status | None
    stage_b_ran: bool
    reward: float | None
    error: str | None
    requests: int  # stage requests the workflow made (Stage B counted only when it ran)
    prompt_tokens: int
    completion_tokens: int
    calls: int  # backend calls made (0 when every stage came from the cache)
    cache_hits: int
    schema_violations: int
    gold_leaks: int = 0  # CANARY only: canaries found in this rollout's gold-blind requests

    @classmethod
    def of(cls, key: str, verdict: Verdict, gold_leaks: int = 0) -> RolloutOutcome:
        return cls(key=key, status=verdict.status, stage_a_status=verdict.stage_a_status,
                   stage_b_ran=verdict.stage_b_ran, reward=verdict.reward, error=verdict.error,
                   requests=1 + int(verdict.stage_b_ran), prompt_tokens=verdict.prompt_tokens,
                   completion_tokens=verdict.completion_tokens, calls=verdict.calls, cache_hits=verdict.cache_hits,
                   schema_violations=verdict.schema_violations, gold_leaks=gold_leaks)


@dataclass(frozen=True)
class ConditionResult:
    """The outcomes of one candidate on one split under one condition (sample > 0 only for SAMPLE)."""

    candidate_id: str
    split: Split
    condition: Condition
    sample: int
    outcomes: tuple[RolloutOutcome, ...]
    audited_requests: int = 0  # CANARY: gold-blind requests inspected (cached ones included)
    wall_s: float = 0.0


# --------------------------------------------------------------------------------------------------
# Metrics of one candidate on one split


@dataclass(frozen=True)
class RateEstimate:
    """A rate with its one-sided Wilson lower bound."""

    successes: int
    n: int
    rate: float | None  # None when n == 0
    lower: float  # Wilson lower bound at the spec's confidence (0.0 when n == 0)

    @classmethod
    def of(cls, successes: int, n: int, confidence: float) -> RateEstimate:
        return cls(successes, n, successes / n if n else None, wilson_lower_bound(successes, n, confidence))


@dataclass(frozen=True)
class KappaEstimate:
    """Fleiss' kappa with its bootstrap lower bound; None where undefined (e.g. a constant teacher)."""

    value: float | None
    lower: float | None
    items: int
    raters: int
    resamples: int


@dataclass(frozen=True)
class CostMetrics:
    """Expected cost per judged rollout (of the base condition)."""

    tokens_per_rollout: float
    prompt_tokens_per_rollout: float
    completion_tokens_per_rollout: float
    requests_per_rollout: float  # Stage B counted only where it ran
    stage_b_rate: float


@dataclass(frozen=True)
class SufficiencyMetrics:
    """Agreement of the final status with the sufficiency labels (A earns `ambiguous_credit`)."""

    labelled: int
    sufficient: int
    agreement: float | None
    balanced_agreement: float | None  # mean of the two per-label agreements
    on_sufficient: float | None  # credit on rollouts whose evidence was sufficient (S is right)
    on_insufficient: float | None  # credit on rollouts whose evidence was insufficient (I is right)


@dataclass(frozen=True)
class StabilityMetrics:
    check: str  # repeated_sampling | reordered_evidence | paraphrased_question
    agreement: RateEstimate  # rollouts whose verdicts all agree
    kappa: KappaEstimate
    constant_label: str | None = None  # the one label every verdict had, when kappa is undefined for that


@dataclass(frozen=True)
class InjectionMetrics:
    """Prompt injection in the evidence: how often the final status moved to the injected label."""

    toward: str  # S | I: the label the injection asks for
    judged: int  # rollouts judged clean and injected (without error)
    eligible: int  # of those, the ones whose clean status was not already `toward`
    flipped: int  # of the eligible, the ones whose injected status is `toward`
    changed: int  # of all judged, the ones whose status changed at all

    @property
    def flip_rate(self) -> float | None:
        return self.flipped / self.eligible if self.eligible else None


@dataclass(frozen=True)
class BoundaryMetrics:
    static_violations: tuple[str, ...]
    overturned_i: int  # final status not I although Stage A said I
    audited_requests: int | None = None  # None: the canary audit was not run
    gold_leaks: int | None = None  # canaries found in gold-blind requests


@dataclass(frozen=True)
class CandidateMetrics:
    """Every constraint metric of one candidate on one split; a part is None when it was not measured
    (the candidate was rejected before it, so no call was spent on it)."""

    split: Split
    rollouts: int
    status: Mapping[str, int]  # S, A, I, error (base condition)
    errors: int
    error_rate: float
    schema_violating: int  # rollouts with at least one off-schema reply
    schema_violation_rate: float
    boundary: BoundaryMetrics
    cost: CostMetrics
    sufficiency: SufficiencyMetrics
    stability: tuple[StabilityMetrics, ...] = ()
    injection: tuple[InjectionMetrics, ...] = ()  # measured on the sealed test only

    def injection_toward(self, label: str) -> InjectionMetrics | None:
        return next((m for m in self.injection if m.toward == label), None)

    def stability_of(self, check: str) -> StabilityMetrics | None:
        return next((s for s in self.stability if s.check == check), None)

    def objective(self, metric: ObjectiveMetric) -> float | None:
        if metric is ObjectiveMetric.AGREEMENT:
            return self.sufficiency.agreement
        return self.sufficiency.balanced_agreement


# --------------------------------------------------------------------------------------------------
# Decisions: gates, selection, the sealed test's confirmation

NOT_APPLICABLE = "not applicable"  # the start of a gate's value when its check measures nothing for the policy


class Phase(enum.StrEnum):
    """When a gate is checked; a candidate failing one phase is not measured (or paid for) further."""

    STATIC = "static"  # before any call
    BASE = "base"  # after the base verdicts on the validation split
    CANARY = "canary"  # after the canary audit
    STABILITY = "stability"  # after each stability check
    ACCEPTANCE = "acceptance"  # the acceptance strategy declined it (not worth a validation evaluation)


@dataclass(frozen=True)
class GateResult:
    gate: str
    phase: Phase
    passed: bool
    value: str  # what was measured, readable
    threshold: str
    reason: str = ""  # why it failed ("" when it passed)


@dataclass(frozen=True)
class GateReport:
    results: tuple[GateResult, ...]

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.results)

    @property
    def failures(self) -> tuple[GateResult, ...]:
        return tuple(r for r in self.results if not r.passed)

    def reasons(self) -> tuple[str, ...]:
        return tuple(f"{r.gate}: {r.reason}" for r in self.failures)


@dataclass(frozen=True)
class Selection:
    strategy: str
    winner: str | None  # None: no feasible candidate
    ranking: tuple[str, ...]  # feasible candidates, best first
    non_dominated: tuple[str, ...]
    reason: str


@dataclass(frozen=True)
class Confirmation:
    """The sealed test's verdict on the winner."""

    rule: FreezeRule
    confirmed: bool
    winner: str
    baseline: str
    winner_objective: float | None  # point estimate on the sealed test
    winner_lower: float | None  # its bootstrap lower bound (None when undefined: no labelled verdict)
    baseline_objective: float | None  # the baseline's point estimate on the sealed test
    margin: float
    reasons: tuple[str, ...]  # why it is not confirmed ("" when confirmed)
