"""The sealed test: opened once, after the logged selection; the winner and the manual single-prompt
baseline measured on it with every condition, and with a prompt injection toward S and toward I in the
evidence (reported, not gated); the spec's freeze rule applied (`ape.confirm`)."""

from __future__ import annotations

from eviback.ape.candidates import static_rejections
from eviback.ape.confirm import confirm
from eviback.ape.context import StageContext
from eviback.ape.events import EvaluatedOnTest, TestConfirmation, UnsealedTest
from eviback.ape.gates import full_report, not_applicable
from eviback.ape.measure import INJECTED
from eviback.ape.records import Candidate, Condition, Confirmation, Origin, Split, structure_key
from eviback.ape.rollouts import Rollout, subset
from eviback.teacher.policy import TeacherPolicy, load_policy

BASELINE = "single-prompt-dual-task"  # the manual policy the winner is compared with on the sealed test
BASELINE_ID = "baseline"  # its id when it is not one of the seeds


def test_rollouts(ctx: StageContext) -> tuple[Rollout, ...]:
    if ctx.state.selected is None:
        raise RuntimeError("the sealed test split is read only after a selection")
    return ctx.splits.test.unseal(f"selection@{ctx.state.selected[0]}")


def baseline(ctx: StageContext) -> tuple[str, TeacherPolicy]:
    policy = load_policy(BASELINE)
    seed = next((c for c in ctx.state.candidates.values() if c.origin is Origin.SEED and
                 c.structure == structure_key(policy)), None)
    return (seed.id, seed.policy) if seed is not None else (BASELINE_ID, policy)


def measure_on_test(ctx: StageContext, winner: Candidate) -> None:
    seq, _ = ctx.state.selected  # type: ignore[misc]
    base_id, base_policy = baseline(ctx)
    targets: list[tuple[str, TeacherPolicy]] = [(winner.id, winner.policy), (base_id, base_policy)]
    rollouts = test_rollouts(ctx)
    if ctx.state.unsealed is None:
        ctx.emit(UnsealedTest(seq, tuple(t[0] for t in targets)))
        ctx.progress(f"sealed test split opened for selection {seq}: {len(rollouts)} rollouts")
    for cid, policy in targets:
        if cid in ctx.state.tests:
            continue
        ctx.judging.judged((cid, policy), Split.TEST, rollouts, Condition.BASE)
        sub = subset(rollouts, ctx.spec.stability.rollouts, ctx.spec.data.salt)  # canaries and injections
        ctx.judging.judged((cid, policy), Split.TEST, sub, Condition.CANARY)
        for check, rule in ctx.spec.stability.checks().items():
            if rule.enabled and not not_applicable(check, policy):
                ctx.judging.conditions((cid, policy), Split.TEST, rollouts, check)
        for condition in INJECTED:  # reported, not gated: how far text in the evidence moves the verdict
            ctx.judging.judged((cid, policy), Split.TEST, sub, condition)
        metrics = ctx.judging.metrics(policy, cid, Split.TEST)
        rejections = static_rejections(policy, max_stages=ctx.spec.search.max_stages)
        ctx.emit(EvaluatedOnTest(cid, Split.TEST, metrics, full_report(metrics, rejections, ctx.spec, policy)))


def confirm_on_test(ctx: StageContext, winner: Candidate) -> Confirmation:
    """The spec's freeze rule on the sealed test (logged once)."""
    if ctx.state.confirmation is None:
        base_id = ctx.state.unsealed.candidate_ids[-1]  # type: ignore[union-attr]
        labels = {r.key: r.sufficient for r in test_rollouts(ctx)}
        confirmation = confirm(winner.id, ctx.state.results[(winner.id, Split.TEST, Condition.BASE, 0)].outcomes,
                               ctx.state.tests[winner.id].report, base_id, ctx.state.tests[base_id].metrics, labels,
                               ctx.spec)
        ctx.emit(TestConfirmation(confirmation))
        verdict = "confirmed" if confirmation.confirmed else "NOT confirmed: " + "; ".join(confirmation.reasons)
        ctx.progress(f"sealed test: {winner.id} {verdict}")
    assert ctx.state.confirmation is not None
    return ctx.state.confirmation
