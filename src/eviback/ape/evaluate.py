"""Gate by gate on the validation split: a candidate stops, and stops costing, at its first failed gate."""

from __future__ import annotations

from typing import TYPE_CHECKING

from eviback.ape.candidates import Candidate, static_rejections
from eviback.ape.events import CandidateEvaluated, CandidateRejected
from eviback.ape.feedback import feedback_score
from eviback.ape.gates import (
    GateReport,
    Phase,
    base_gates,
    canary_gates,
    not_applicable,
    not_applicable_gate,
    stability_gate,
    static_gates,
)
from eviback.ape.measure import Condition
from eviback.ape.rollouts import Split

if TYPE_CHECKING:
    from eviback.ape.pipeline import ApeRun


def evaluate(run: ApeRun, c: Candidate) -> None:
    if c.id in run.decided:
        return
    reasons = list(static_rejections(c.policy, max_stages=run.spec.search.max_stages))
    earlier = next((o for o in run.candidates.values() if o.id != c.id and o.structure == c.structure
                    and run.order(o) < run.order(c)), None)
    if earlier is not None:
        reasons.append(f"duplicate of {earlier.id} (the same workflow)")
    if reasons:
        run.progress(f"{c.id} {c.policy.name}: rejected before any call: {'; '.join(reasons)}")
        run.emit(CandidateRejected(c.id, Phase.STATIC, tuple(reasons), GateReport(tuple(static_gates(reasons)))))
        return
    if c.parent and c.round > 0 and run.acceptance.needs_feedback:
        ok, why = run.acceptance.accept(feedback_score(run, c), feedback_score(run, run.candidates[c.parent]))
        if not ok:
            run.progress(f"{c.id}: not accepted: {why}")
            run.emit(CandidateRejected(c.id, Phase.ACCEPTANCE, (why,), GateReport(())))
            return
    run.progress(f"{c.id} {c.policy.name}: evaluating on {len(run.splits.validation)} validation rollouts")
    val = run.splits.validation
    run.judged(c, Split.VALIDATION, val, Condition.BASE)
    gates = static_gates(()) + base_gates(run.metrics(c.policy, c.id, Split.VALIDATION), run.spec)
    if reject_if_failed(run, c, Phase.BASE, gates):
        return
    run.judged(c, Split.VALIDATION, run.stability_subset, Condition.CANARY)
    gates += canary_gates(run.metrics(c.policy, c.id, Split.VALIDATION), run.spec)
    if reject_if_failed(run, c, Phase.CANARY, gates):
        return
    # cheapest first: one extra verdict per rollout for a perturbation, samples-1 for repeated sampling
    for check in ("reordered_evidence", "paraphrased_question", "repeated_sampling"):
        rule = run.spec.stability.checks()[check]
        if not rule.enabled:
            continue
        why = not_applicable(check, c.policy)
        if why:
            gates.append(not_applicable_gate(check, why, rule))
            continue
        run.conditions(c, Split.VALIDATION, val, check)
        metrics = run.metrics(c.policy, c.id, Split.VALIDATION)
        gates.append(stability_gate(check, metrics.stability_of(check), rule, run.spec))
        if reject_if_failed(run, c, Phase.STABILITY, gates):
            return
    metrics = run.metrics(c.policy, c.id, Split.VALIDATION)
    objective = metrics.objective(run.spec.objective.metric)
    run.progress(f"{c.id} {c.policy.name}: FEASIBLE, objective {objective if objective is None else round(objective, 4)}, "
                  f"{metrics.cost.tokens_per_rollout:.0f} tokens/rollout")
    run.emit(CandidateEvaluated(c.id, metrics, GateReport(tuple(gates))))


def reject_if_failed(run: ApeRun, c: Candidate, phase: Phase, gates: list) -> bool:
    report = GateReport(tuple(gates))
    if report.passed:
        return False
    metrics = run.metrics(c.policy, c.id, Split.VALIDATION)
    run.progress(f"{c.id} {c.policy.name}: rejected ({phase.value}): {'; '.join(report.reasons())}")
    run.emit(CandidateRejected(c.id, phase, report.reasons(), report, metrics))
    return True
