"""The sealed test: opened once, after the logged selection; the winner and the manual single-prompt
baseline measured on it with every condition, and with a prompt injection toward S and toward I in the
evidence (reported, not gated); the spec's freeze rule applied (`ape.confirm`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from eviback.ape.candidates import Candidate, Origin, static_rejections, structure_key
from eviback.ape.confirm import Confirmation, confirm
from eviback.ape.events import EvaluatedOnTest, TestConfirmation, UnsealedTest
from eviback.ape.gates import full_report, not_applicable
from eviback.ape.measure import INJECTED, Condition
from eviback.ape.rollouts import Rollout, Split, subset
from eviback.teacher.policy import TeacherPolicy, load_policy

BASELINE = "single-prompt-dual-task"  # the manual policy the winner is compared with on the sealed test
BASELINE_ID = "baseline"  # its id when it is not one of the seeds

if TYPE_CHECKING:
    from eviback.ape.pipeline import ApeRun


def test_rollouts(run: ApeRun) -> tuple[Rollout, ...]:
    if run.selected is None:
        raise RuntimeError("the sealed test split is read only after a selection")
    return run.splits.test.unseal(f"selection@{run.selected[0]}")


def baseline(run: ApeRun) -> tuple[str, TeacherPolicy]:
    policy = load_policy(BASELINE)
    seed = next((c for c in run.candidates.values() if c.origin is Origin.SEED and
                 c.structure == structure_key(policy)), None)
    return (seed.id, seed.policy) if seed is not None else (BASELINE_ID, policy)


def measure_on_test(run: ApeRun, winner: Candidate) -> None:
    seq, _ = run.selected  # type: ignore[misc]
    base_id, base_policy = baseline(run)
    targets: list[tuple[str, TeacherPolicy]] = [(winner.id, winner.policy), (base_id, base_policy)]
    rollouts = test_rollouts(run)
    if run.unsealed is None:
        run.emit(UnsealedTest(seq, tuple(t[0] for t in targets)))
        run.progress(f"sealed test split opened for selection {seq}: {len(rollouts)} rollouts")
    for cid, policy in targets:
        if cid in run.tests:
            continue
        run.judged((cid, policy), Split.TEST, rollouts, Condition.BASE)
        sub = subset(rollouts, run.spec.stability.rollouts, run.spec.data.salt)  # canaries and injections
        run.judged((cid, policy), Split.TEST, sub, Condition.CANARY)
        for check, rule in run.spec.stability.checks().items():
            if rule.enabled and not not_applicable(check, policy):
                run.conditions((cid, policy), Split.TEST, rollouts, check)
        for condition in INJECTED:  # reported, not gated: how far text in the evidence moves the verdict
            run.judged((cid, policy), Split.TEST, sub, condition)
        metrics = run.metrics(policy, cid, Split.TEST)
        rejections = static_rejections(policy, max_stages=run.spec.search.max_stages)
        run.emit(EvaluatedOnTest(cid, Split.TEST, metrics, full_report(metrics, rejections, run.spec, policy)))


def confirm_on_test(run: ApeRun, winner: Candidate) -> Confirmation:
    """The spec's freeze rule on the sealed test (logged once)."""
    if run.confirmation is None:
        base_id = run.unsealed.candidate_ids[-1]  # type: ignore[union-attr]
        labels = {r.key: r.sufficient for r in test_rollouts(run)}
        confirmation = confirm(winner.id, run.results[(winner.id, Split.TEST, Condition.BASE, 0)].outcomes,
                               run.tests[winner.id].report, base_id, run.tests[base_id].metrics, labels,
                               run.spec)
        run.emit(TestConfirmation(confirmation))
        verdict = "confirmed" if confirmation.confirmed else "NOT confirmed: " + "; ".join(confirmation.reasons)
        run.progress(f"sealed test: {winner.id} {verdict}")
    assert run.confirmation is not None
    return run.confirmation
