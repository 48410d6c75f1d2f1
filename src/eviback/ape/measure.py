"""Measuring a candidate: judge rollouts under each condition with the teacher machinery, then compute the
constraint metrics from the per-rollout outcomes.

Conditions (:class:`~eviback.ape.records.Condition`): the base verdict; teacher sample k (repeated
sampling); the evidence in another order; the question reworded; canaries planted in the gold answers (the
dynamic boundary audit, a :class:`~eviback.teacher.boundary.CanaryAudit` on every request). Judging goes
through :class:`~eviback.teacher.judge.Teacher`: concurrent, retried, cached (a compliant candidate's Stage A
requests under canaries are byte-identical to the base ones, so they are cache hits), costed.

:func:`judge_condition` returns one :class:`~eviback.ape.records.RolloutOutcome` per rollout (a record small
enough to be logged: resuming replays it instead of judging again). :func:`compute_metrics` is a pure
function of outcomes and labels, so every number in a report can be recomputed from the run's event log.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from eviback.ape.records import (
    BoundaryMetrics,
    CandidateMetrics,
    Condition,
    ConditionResult,
    CostMetrics,
    InjectionMetrics,
    KappaEstimate,
    RateEstimate,
    RolloutOutcome,
    Split,
    StabilityMetrics,
    SufficiencyMetrics,
)
from eviback.ape.rollouts import Rollout, paraphrase_question, reorder_evidence
from eviback.ape.spec import ConstraintSpec
from eviback.ape.stats import bootstrap_lower_bound, fleiss_kappa
from eviback.teacher.boundary import CanaryAudit, plant_canaries
from eviback.teacher.cache import ReplyCache
from eviback.teacher.chat import TeacherClient
from eviback.teacher.judge import JudgeConfig, Teacher
from eviback.teacher.policy import TeacherPolicy
from eviback.teacher.probes import INJECTIONS, INJECTIONS_TO_I, inject
from eviback.types import Status, Verdict

STATUSES = (Status.SUFFICIENT, Status.AMBIGUOUS, Status.INSUFFICIENT)


# The prompt injection of each injected condition (sealed test only), and the label it pushes toward.
INJECTED = {
    Condition.INJECTED_S: (INJECTIONS[1], Status.SUFFICIENT),
    Condition.INJECTED_I: (INJECTIONS_TO_I[1], Status.INSUFFICIENT),
}


Progress = Callable[[str], None]


@dataclass
class JudgeBackend:
    """The teacher backend every candidate is judged on: one client, one cache, one judge config."""

    client: TeacherClient
    cache: ReplyCache | None
    config: JudgeConfig = field(default_factory=JudgeConfig)
    chunk: int = 8  # rollouts per progress line
    paraphrases: Mapping[str, str] = field(default_factory=dict)
    salt: str = "eviback-ape"

    def judge_condition(self, candidate_id: str, policy: TeacherPolicy, split: Split, rollouts: Sequence[Rollout],
                        condition: Condition, sample: int = 0, progress: Progress | None = None) -> ConditionResult:
        """Judge `rollouts` with `policy` under `condition`; never raises for one failed rollout."""
        keys: list[str] = []
        trajectories = []
        for r in rollouts:
            t = r.trajectory
            if condition is Condition.REORDERED:
                t = reorder_evidence(t, self.salt)
                if t is None:
                    continue  # fewer than 2 passages: no other order exists
            elif condition is Condition.PARAPHRASED:
                t = paraphrase_question(t, self.paraphrases)
            elif condition in INJECTED:
                if not any(turn.passages for turn in t.turns):
                    continue  # nothing retrieved: no passage to carry the injection
                t = inject(t, INJECTED[condition][0])
            keys.append(r.key)
            trajectories.append(t)
        audit = None
        canaries: tuple[str, ...] = ()
        if condition is Condition.CANARY:
            trajectories, canaries = plant_canaries(trajectories, seed=len(trajectories))
            audit = CanaryAudit(policy, canaries)
        teacher = Teacher(policy, self.client, self.config, cache=self.cache, on_request=audit)
        start = time.perf_counter()
        verdicts: list[Verdict] = []
        label = f"{condition.value}-{sample}" if condition is Condition.SAMPLE else condition.value
        for i in range(0, len(trajectories), self.chunk):
            verdicts += teacher.judge(trajectories[i:i + self.chunk], sample_index=sample)
            if progress is not None:
                stats = teacher.stats().total
                progress(f"{candidate_id} {split.value}/{label}: {len(verdicts)}/{len(trajectories)} rollouts, "
                         f"{stats.calls} calls, {stats.cache_hits} cache hits, {time.perf_counter() - start:.0f}s")
        leaks = collections.Counter(leak.canary for leak in audit.leaks) if audit is not None else {}
        outcomes = tuple(RolloutOutcome.of(k, v, leaks.get(canaries[i], 0) if canaries else 0)
                         for i, (k, v) in enumerate(zip(keys, verdicts, strict=True)))
        return ConditionResult(candidate_id, split, condition, sample, outcomes,
                               audited_requests=audit.checked if audit is not None else 0,
                               wall_s=round(time.perf_counter() - start, 2))


# --------------------------------------------------------------------------------------------------
# Metrics (pure functions of outcomes and labels)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _credit(status: Status, sufficient: bool, ambiguous_credit: float) -> float:
    if status is Status.AMBIGUOUS:
        return ambiguous_credit
    return float((status is Status.SUFFICIENT) == sufficient)


def sufficiency_metrics(outcomes: Sequence[RolloutOutcome], labels: Mapping[str, bool | None],
                        ambiguous_credit: float) -> SufficiencyMetrics:
    pairs = [(o.status, labels[o.key]) for o in outcomes if o.status is not None and labels.get(o.key) is not None]
    on_s = [_credit(s, True, ambiguous_credit) for s, y in pairs if y]
    on_i = [_credit(s, False, ambiguous_credit) for s, y in pairs if not y]
    both = on_s + on_i
    return SufficiencyMetrics(
        labelled=len(pairs), sufficient=len(on_s),
        agreement=_mean(both) if both else None,
        balanced_agreement=(_mean(on_s) + _mean(on_i)) / 2 if on_s and on_i else (_mean(both) if both else None),
        on_sufficient=_mean(on_s) if on_s else None, on_insufficient=_mean(on_i) if on_i else None)


def cost_metrics(outcomes: Sequence[RolloutOutcome]) -> CostMetrics:
    return CostMetrics(
        tokens_per_rollout=round(_mean([o.prompt_tokens + o.completion_tokens for o in outcomes]), 2),
        prompt_tokens_per_rollout=round(_mean([o.prompt_tokens for o in outcomes]), 2),
        completion_tokens_per_rollout=round(_mean([o.completion_tokens for o in outcomes]), 2),
        requests_per_rollout=round(_mean([o.requests for o in outcomes]), 4),
        stage_b_rate=round(_mean([float(o.stage_b_ran) for o in outcomes]), 4))


def stability_metrics(check: str, ratings: Sequence[Sequence[Status]], *, confidence: float, resamples: int,
                      seed: int) -> StabilityMetrics:
    """Agreement and kappa of `ratings[item] = (status of rater 1, rater 2, ...)` (same raters per item)."""
    table = [[sum(r is s for r in row) for s in STATUSES] for row in ratings]
    agree = sum(max(row) == len(ratings[i]) for i, row in enumerate(table))
    raters = len(ratings[0]) if ratings else 0
    value = fleiss_kappa(table) if ratings else None
    lower = bootstrap_lower_bound(table, fleiss_kappa, confidence=confidence, resamples=resamples,
                                  seed=seed) if value is not None else None
    labels = {r for row in ratings for r in row}
    constant = next(iter(labels)).value if len(labels) == 1 else None
    return StabilityMetrics(check, RateEstimate.of(agree, len(ratings), confidence),
                            KappaEstimate(value, lower, len(ratings), raters, resamples), constant)


def _ratings(results: Sequence[ConditionResult]) -> list[list[Status]]:
    """Per rollout (present without error in every result), its statuses in result order."""
    maps = [{o.key: o.status for o in r.outcomes if o.status is not None} for r in results]
    keys = sorted(set.intersection(*(set(m) for m in maps))) if maps else []
    return [[m[k] for m in maps] for k in keys]


STABILITY_CONDITIONS = {
    "repeated_sampling": Condition.SAMPLE,
    "reordered_evidence": Condition.REORDERED,
    "paraphrased_question": Condition.PARAPHRASED,
}


def compute_metrics(policy: TeacherPolicy, split: Split, results: Sequence[ConditionResult],
                    labels: Mapping[str, bool | None], spec: ConstraintSpec) -> CandidateMetrics:
    """The metrics of one candidate on one split from whatever conditions were judged (BASE is required)."""
    by_condition: dict[Condition, list[ConditionResult]] = collections.defaultdict(list)
    for r in results:
        by_condition[r.condition].append(r)
    if not by_condition[Condition.BASE]:
        raise ValueError("compute_metrics needs the base condition")
    base = by_condition[Condition.BASE][0]
    outcomes = base.outcomes
    status = collections.Counter(o.status.value for o in outcomes if o.status is not None)
    errors = sum(o.error is not None for o in outcomes)
    violating = sum(o.schema_violations > 0 for o in outcomes)
    n = len(outcomes)
    overturned = sum(o.stage_a_status is Status.INSUFFICIENT and o.status is not Status.INSUFFICIENT
                     and o.status is not None for r in results for o in r.outcomes)
    canary = by_condition[Condition.CANARY]
    boundary = BoundaryMetrics(
        static_violations=policy.boundary_violations(), overturned_i=overturned,
        audited_requests=canary[0].audited_requests if canary else None,
        gold_leaks=sum(o.gold_leaks for o in canary[0].outcomes) if canary else None)
    stability = []
    st = spec.stability
    for check, condition in STABILITY_CONDITIONS.items():
        perturbed = sorted(by_condition[condition], key=lambda r: r.sample)
        if not perturbed:
            continue
        if condition is Condition.SAMPLE:
            if len(perturbed) < st.samples - 1:
                continue  # an interrupted check is not a measurement
            perturbed = perturbed[: st.samples - 1]
        keys = {o.key for o in perturbed[0].outcomes}
        base_subset = ConditionResult(base.candidate_id, split, Condition.BASE, 0,
                                      tuple(o for o in outcomes if o.key in keys))
        ratings = _ratings([base_subset, *perturbed])
        stability.append(stability_metrics(check, ratings, confidence=st.confidence,
                                           resamples=st.bootstrap_resamples, seed=spec.search.seed))
    clean = {o.key: o.status for o in outcomes if o.status is not None}
    injection = []
    for condition, (_, toward) in INJECTED.items():
        for r in by_condition[condition][:1]:
            pairs = [(clean[o.key], o.status) for o in r.outcomes if o.status is not None and o.key in clean]
            eligible = [after for before, after in pairs if before is not toward]
            injection.append(InjectionMetrics(toward.value, len(pairs), len(eligible),
                                              sum(after is toward for after in eligible),
                                              sum(before is not after for before, after in pairs)))
    return CandidateMetrics(
        split=split, rollouts=n, status={k: status.get(k, 0) for k in ("S", "A", "I")} | {"error": errors},
        errors=errors, error_rate=errors / n if n else 0.0, schema_violating=violating,
        schema_violation_rate=violating / n if n else 0.0, boundary=boundary, cost=cost_metrics(outcomes),
        sufficiency=sufficiency_metrics(outcomes, labels, spec.objective.ambiguous_credit),
        stability=tuple(stability), injection=tuple(injection))
