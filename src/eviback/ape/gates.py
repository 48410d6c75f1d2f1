"""Gates, acceptance and selection: constraints decide feasibility, then the objective ranks.

- Gates (:func:`static_gates`, :func:`base_gates`, :func:`canary_gates`, :func:`stability_gate`) turn metrics
  into :class:`~eviback.ape.records.GateResult` records, each with the measured value, the threshold and, on
  failure, the reason. Stability gates compare the *lower confidence bounds* (Wilson for agreement, bootstrap
  for kappa) with the thresholds, never the point estimates.
- Acceptance (which new candidate is worth a validation evaluation) and selection (which feasible candidate
  wins) are swappable strategies looked up by name in small registries (:data:`ACCEPTANCE`,
  :data:`SELECTION`); unknown names raise with the known ones.
- :func:`non_dominated` is the Pareto set of the feasible candidates on (objective up, tokens per rollout
  down, stability floor up).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from eviback.ape.records import (
    NOT_APPLICABLE,
    CandidateMetrics,
    GateReport,
    GateResult,
    Phase,
    Selection,
    StabilityMetrics,
)
from eviback.ape.spec import ConstantTeacher, ConstraintSpec, StabilityCheck
from eviback.teacher.policy import TeacherPolicy


def _gate(gate: str, phase: Phase, passed: bool, value: str, threshold: str, reason: str) -> GateResult:
    return GateResult(gate, phase, passed, value, threshold, "" if passed else reason)


def static_gates(rejections: Sequence[str]) -> list[GateResult]:
    """The static checks as gates (see `candidates.static_rejections`)."""
    boundary = [r for r in rejections if r.startswith("evidence boundary")]
    other = [r for r in rejections if not r.startswith("evidence boundary")]
    return [
        _gate("gold reaches Stage A (static)", Phase.STATIC, not boundary, f"{len(boundary)} violation(s)", "0",
              "; ".join(boundary)),
        _gate("workflow structure", Phase.STATIC, not other, f"{len(other)} problem(s)", "0", "; ".join(other)),
    ]


def base_gates(m: CandidateMetrics, spec: ConstraintSpec) -> list[GateResult]:
    hard, cost = spec.hard_gates, spec.cost
    return [
        _gate("I overturned", Phase.BASE, m.boundary.overturned_i <= hard.max_overturned_i,
              str(m.boundary.overturned_i), str(hard.max_overturned_i),
              f"{m.boundary.overturned_i} verdict(s) with Stage A I ended not I"),
        _gate("schema violations", Phase.BASE, m.schema_violation_rate <= hard.max_schema_violation_rate,
              f"{m.schema_violation_rate:.3f} ({m.schema_violating}/{m.rollouts})",
              f"<= {hard.max_schema_violation_rate:g}",
              f"{m.schema_violating}/{m.rollouts} rollouts had an off-schema reply"),
        _gate("teacher errors", Phase.BASE, m.error_rate <= hard.max_error_rate,
              f"{m.error_rate:.3f} ({m.errors}/{m.rollouts})", f"<= {hard.max_error_rate:g}",
              f"{m.errors}/{m.rollouts} rollouts ended as teacher_error"),
        _gate("tokens per rollout", Phase.BASE, m.cost.tokens_per_rollout <= cost.max_tokens_per_rollout,
              f"{m.cost.tokens_per_rollout:.0f}", f"<= {cost.max_tokens_per_rollout:g}",
              f"{m.cost.tokens_per_rollout:.0f} tokens per judged rollout exceed the budget"),
        _gate("calls per rollout", Phase.BASE, m.cost.requests_per_rollout <= cost.max_calls_per_rollout,
              f"{m.cost.requests_per_rollout:.2f}", f"<= {cost.max_calls_per_rollout:g}",
              f"{m.cost.requests_per_rollout:.2f} calls per judged rollout exceed the budget"),
    ]


def canary_gates(m: CandidateMetrics, spec: ConstraintSpec) -> list[GateResult]:
    b = m.boundary
    if b.gold_leaks is None or b.audited_requests is None:
        return [_gate("gold reaches Stage A (canaries)", Phase.CANARY, False, "not measured", "0",
                      "the canary audit did not run")]
    ok = b.gold_leaks <= spec.hard_gates.max_stage_a_gold_requests and b.audited_requests > 0
    reason = (f"canaries planted in the gold answers were found {b.gold_leaks} time(s) in requests to "
              f"gold-blind stages" if b.gold_leaks else "no gold-blind request was audited")
    return [_gate("gold reaches Stage A (canaries)", Phase.CANARY, ok,
                  f"{b.gold_leaks} leak(s) in {b.audited_requests} audited request(s)", "0", reason)]


def stability_gate(check: str, s: StabilityMetrics | None, rule: StabilityCheck, spec: ConstraintSpec) -> GateResult:
    name = check.replace("_", " ")
    threshold = f"agreement LB >= {rule.min_agreement:g}" + (
        f", kappa LB >= {rule.min_kappa:g}" if rule.min_kappa is not None else "")
    if s is None:
        return _gate(name, Phase.STABILITY, False, "not measured", threshold, "not measured")
    a, k = s.agreement, s.kappa
    value = (f"agreement {a.rate if a.rate is not None else float('nan'):.3f} (LB {a.lower:.3f}, n={a.n}), "
             f"kappa {_num(k.value)} (LB {_num(k.lower)})")
    reasons = []
    if a.lower < rule.min_agreement:
        reasons.append(f"agreement lower bound {a.lower:.3f} < {rule.min_agreement:g} ({a.successes}/{a.n} agree)")
    if rule.min_kappa is not None:
        if k.value is None:
            if s.constant_label is not None and spec.stability.constant_teacher is ConstantTeacher.PASS:
                pass
            elif s.constant_label is not None:
                reasons.append(f"kappa undefined: every verdict was {s.constant_label} (a constant teacher carries "
                               f"no information; stability.constant_teacher: pass would accept it)")
            else:
                reasons.append("kappa undefined (no rollout could be compared)")
        elif k.lower is None or k.lower < rule.min_kappa:
            reasons.append(f"kappa lower bound {_num(k.lower)} < {rule.min_kappa:g}")
    return _gate(name, Phase.STABILITY, not reasons, value, threshold, "; ".join(reasons))


def not_applicable(check: str, policy: TeacherPolicy) -> str | None:
    """Why `check` cannot measure anything for `policy` (None: it can). Repeated sampling of a policy whose
    every stage decodes greedily repeats one output: its agreement would be 1.00 by construction, not a
    measurement, so the check is reported as not applicable instead."""
    if check == "repeated_sampling" and all(s.deterministic for s in policy.stages):
        return ("every stage decodes greedily (temperature 0) or is a trained classifier: repeated samples are "
                "identical by construction")
    return None


def not_applicable_gate(check: str, why: str, rule: StabilityCheck) -> GateResult:
    """A stability check that measures nothing for this policy: recorded, never counted as agreement 1.00."""
    threshold = f"agreement LB >= {rule.min_agreement:g}" + (
        f", kappa LB >= {rule.min_kappa:g}" if rule.min_kappa is not None else "")
    return _gate(check.replace("_", " "), Phase.STABILITY, True, f"{NOT_APPLICABLE}: {why}", threshold, "")


def _num(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def full_report(m: CandidateMetrics, rejections: Sequence[str], spec: ConstraintSpec,
                policy: TeacherPolicy) -> GateReport:
    """Every gate on every measured part (used for the sealed-test comparison, where nothing short-circuits)."""
    results = static_gates(rejections) + base_gates(m, spec)
    if m.boundary.gold_leaks is not None:
        results += canary_gates(m, spec)
    for check, rule in spec.stability.checks().items():
        if rule.enabled:
            why = not_applicable(check, policy)
            results.append(not_applicable_gate(check, why, rule) if why else
                           stability_gate(check, m.stability_of(check), rule, spec))
    return GateReport(tuple(results))


def stability_floor(m: CandidateMetrics) -> float | None:
    """The lowest agreement lower bound over the measured stability checks."""
    bounds = [s.agreement.lower for s in m.stability]
    return min(bounds) if bounds else None


# --------------------------------------------------------------------------------------------------
# Acceptance: does a new candidate deserve a validation evaluation?


class Acceptance(Protocol):
    name: str
    needs_feedback: bool  # whether the candidate must first be judged on the training feedback rollouts

    def accept(self, candidate: float | None, parent: float | None) -> tuple[bool, str]: ...


@dataclass(frozen=True)
class AlwaysAccept:
    name: str = "always"
    needs_feedback: bool = False

    def accept(self, candidate: float | None, parent: float | None) -> tuple[bool, str]:
        return True, ""


@dataclass(frozen=True)
class ImprovesOnFeedback:
    """GEPA's rule: a proposal proceeds only if it is not worse than its parent on the same training rollouts."""

    name: str = "improves-on-feedback"
    needs_feedback: bool = True

    def accept(self, candidate: float | None, parent: float | None) -> tuple[bool, str]:
        if candidate is None:
            return False, "no objective on the training feedback rollouts (no labelled verdict)"
        if parent is not None and candidate < parent:
            return False, f"worse than its parent on the training feedback rollouts ({candidate:.3f} < {parent:.3f})"
        return True, ""


ACCEPTANCE: dict[str, Acceptance] = {}


def register_acceptance(strategy: Acceptance) -> None:
    if strategy.name in ACCEPTANCE:
        raise ValueError(f"acceptance strategy {strategy.name!r} is already registered")
    ACCEPTANCE[strategy.name] = strategy


def acceptance(name: str) -> Acceptance:
    if name not in ACCEPTANCE:
        raise ValueError(f"unknown acceptance {name!r}; known: {', '.join(ACCEPTANCE)} (spec: search.acceptance)")
    return ACCEPTANCE[name]


register_acceptance(AlwaysAccept())
register_acceptance(ImprovesOnFeedback())


# --------------------------------------------------------------------------------------------------
# Selection among the evaluated candidates


@dataclass(frozen=True)
class Scored:
    """A candidate as selection sees it (validation metrics)."""

    id: str
    feasible: bool
    objective: float | None
    tokens: float
    requests: float
    stability_floor: float | None


class SelectionStrategy(Protocol):
    name: str

    def select(self, scored: Sequence[Scored], spec: ConstraintSpec) -> Selection: ...


def non_dominated(scored: Sequence[Scored]) -> tuple[str, ...]:
    """Feasible candidates no other feasible one beats on every axis (objective up, tokens down, stability
    floor up) and strictly on one."""
    pts = [(s.id, s.objective or 0.0, -s.tokens, s.stability_floor or 0.0) for s in scored if s.feasible]

    def dominates(a: tuple, b: tuple) -> bool:
        return all(x >= y for x, y in zip(a[1:], b[1:], strict=True)) and any(
            x > y for x, y in zip(a[1:], b[1:], strict=True))

    return tuple(p[0] for p in pts if not any(dominates(q, p) for q in pts if q is not p))


@dataclass(frozen=True)
class BestFeasible:
    """The best objective among feasible candidates; within `objective.tie_tolerance` of the best, the
    cheapest (tokens per rollout, then calls per rollout) wins, then the earliest proposed."""

    name: str = "best-feasible"

    def select(self, scored: Sequence[Scored], spec: ConstraintSpec) -> Selection:
        feasible = [s for s in scored if s.feasible and s.objective is not None]
        order = {s.id: i for i, s in enumerate(scored)}
        ranking = sorted(feasible, key=lambda s: (-(s.objective or 0.0), s.tokens, s.requests, order[s.id]))
        front = non_dominated(scored)
        if not ranking:
            return Selection(self.name, None, (), front, "no candidate passed every gate")
        best = ranking[0].objective or 0.0
        tied = [s for s in ranking if (s.objective or 0.0) >= best - spec.objective.tie_tolerance - 1e-12]
        winner = min(tied, key=lambda s: (s.tokens, s.requests, order[s.id]))
        reason = f"best objective {best:.4f} among {len(ranking)} feasible candidate(s)"
        if len(tied) > 1:
            reason += (f"; tied with {', '.join(s.id for s in tied if s is not winner)} (tolerance "
                       f"{spec.objective.tie_tolerance:g}), the cheapest wins ({winner.tokens:.0f} tokens per rollout)")
        ranking = [winner] + [s for s in ranking if s is not winner]
        return Selection(self.name, winner.id, tuple(s.id for s in ranking), front, reason)


SELECTION: dict[str, SelectionStrategy] = {"best-feasible": BestFeasible()}
