"""Gate by gate on the validation split: a candidate stops, and stops costing, at its first failed gate."""

from __future__ import annotations

from eviback.ape.candidates import static_rejections
from eviback.ape.context import StageContext
from eviback.ape.events import CandidateEvaluated, CandidateRejected
from eviback.ape.feedback import feedback_score
from eviback.ape.gates import (
    base_gates,
    canary_gates,
    not_applicable,
    not_applicable_gate,
    stability_gate,
    static_gates,
)
from eviback.ape.records import Candidate, Condition, GateReport, Phase, Split


def evaluate(ctx: StageContext, c: Candidate) -> None:
    if c.id in ctx.state.decided:
        return
    reasons = list(static_rejections(c.policy, max_stages=ctx.spec.search.max_stages))
    earlier = next((o for o in ctx.state.candidates.values() if o.id != c.id and o.structure == c.structure
                    and ctx.state.order(o) < ctx.state.order(c)), None)
    if earlier is not None:
        reasons.append(f"duplicate of {earlier.id} (the same workflow)")
    if reasons:
        ctx.progress(f"{c.id} {c.policy.name}: rejected before any call: {'; '.join(reasons)}")
        ctx.emit(CandidateRejected(c.id, Phase.STATIC, tuple(reasons), GateReport(tuple(static_gates(reasons)))))
        return
    if c.parent and c.round > 0 and ctx.acceptance.needs_feedback:
        ok, why = ctx.acceptance.accept(feedback_score(ctx, c), feedback_score(ctx, ctx.state.candidates[c.parent]))
        if not ok:
            ctx.progress(f"{c.id}: not accepted: {why}")
            ctx.emit(CandidateRejected(c.id, Phase.ACCEPTANCE, (why,), GateReport(())))
            return
    ctx.progress(f"{c.id} {c.policy.name}: evaluating on {len(ctx.splits.validation)} validation rollouts")
    val = ctx.splits.validation
    ctx.judging.judged(c, Split.VALIDATION, val, Condition.BASE)
    gates = static_gates(()) + base_gates(ctx.judging.metrics(c.policy, c.id, Split.VALIDATION), ctx.spec)
    if reject_if_failed(ctx, c, Phase.BASE, gates):
        return
    ctx.judging.judged(c, Split.VALIDATION, ctx.stability_subset, Condition.CANARY)
    gates += canary_gates(ctx.judging.metrics(c.policy, c.id, Split.VALIDATION), ctx.spec)
    if reject_if_failed(ctx, c, Phase.CANARY, gates):
        return
    # cheapest first: one extra verdict per rollout for a perturbation, samples-1 for repeated sampling
    for check in ("reordered_evidence", "paraphrased_question", "repeated_sampling"):
        rule = ctx.spec.stability.checks()[check]
        if not rule.enabled:
            continue
        why = not_applicable(check, c.policy)
        if why:
            gates.append(not_applicable_gate(check, why, rule))
            continue
        ctx.judging.conditions(c, Split.VALIDATION, val, check)
        metrics = ctx.judging.metrics(c.policy, c.id, Split.VALIDATION)
        gates.append(stability_gate(check, metrics.stability_of(check), rule, ctx.spec))
        if reject_if_failed(ctx, c, Phase.STABILITY, gates):
            return
    metrics = ctx.judging.metrics(c.policy, c.id, Split.VALIDATION)
    objective = metrics.objective(ctx.spec.objective.metric)
    ctx.progress(f"{c.id} {c.policy.name}: FEASIBLE, objective {objective if objective is None else round(objective, 4)}, "
                  f"{metrics.cost.tokens_per_rollout:.0f} tokens/rollout")
    ctx.emit(CandidateEvaluated(c.id, metrics, GateReport(tuple(gates))))


def reject_if_failed(ctx: StageContext, c: Candidate, phase: Phase, gates: list) -> bool:
    report = GateReport(tuple(gates))
    if report.passed:
        return False
    metrics = ctx.judging.metrics(c.policy, c.id, Split.VALIDATION)
    ctx.progress(f"{c.id} {c.policy.name}: rejected ({phase.value}): {'; '.join(report.reasons())}")
    ctx.emit(CandidateRejected(c.id, phase, report.reasons(), report, metrics))
    return True
