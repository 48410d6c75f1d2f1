"""The freeze rule on the sealed test, both ways: a winner whose objective lower bound is above the
single-prompt baseline's point estimate is confirmed; one that is not (or fails a gate on the test split)
is not, and the reasons say why."""

from eviback.ape.confirm import confirm, objective_lower_bound
from eviback.ape.measure import compute_metrics
from eviback.ape.records import (
    Condition,
    ConditionResult,
    GateReport,
    GateResult,
    Phase,
    RolloutOutcome,
    Split,
)
from eviback.ape.spec import ConstraintSpec, FreezeRule, spec_from_mapping
from eviback.teacher.policy import load_policy
from eviback.types import Status

S, I = Status.SUFFICIENT, Status.INSUFFICIENT  # noqa: E741 - the status labels
LABELS = {f"k{i}": i % 2 == 0 for i in range(60)}  # 30 sufficient, 30 insufficient
PASSED = GateReport((GateResult("teacher errors", Phase.BASE, True, "0", "0"),))
SPEC = spec_from_mapping({"stability": {"bootstrap_resamples": 300}})


def outcomes(right: int) -> list[RolloutOutcome]:
    """Verdicts on the 60 labelled rollouts, the first `right` of them correct."""
    out = []
    for i, (key, sufficient) in enumerate(LABELS.items()):
        status = (S if sufficient else I) if i < right else (I if sufficient else S)
        out.append(RolloutOutcome(key=key, status=status, stage_a_status=status, stage_b_ran=False, reward=0.0,
                                  error=None, requests=1, prompt_tokens=100, completion_tokens=0, calls=1,
                                  cache_hits=0, schema_violations=0))
    return out


def baseline(right: int):
    result = ConditionResult("b", Split.TEST, Condition.BASE, 0, tuple(outcomes(right)))
    return compute_metrics(load_policy("single-prompt-dual-task"), Split.TEST, [result], LABELS, SPEC)


def test_a_winner_clearly_above_the_baseline_is_confirmed():
    c = confirm("w", outcomes(57), PASSED, "b", baseline(36), LABELS, SPEC)  # 0.95 vs 0.60
    assert c.confirmed and c.reasons == () and c.rule is FreezeRule.LOWER_BOUND_ABOVE_BASELINE
    assert c.baseline_objective == 0.6 and c.baseline_objective < c.winner_lower < c.winner_objective == 0.95


def test_a_winner_whose_lower_bound_is_not_above_the_baseline_is_not_confirmed():
    # 0.70 beats 0.65 as a point estimate, but not with 60 rollouts' uncertainty
    c = confirm("w", outcomes(42), PASSED, "b", baseline(39), LABELS, SPEC)
    assert not c.confirmed and c.winner_objective > c.baseline_objective
    assert "lower bound" in c.reasons[0] and "0.650" in c.reasons[0]
    # a margin turns a clear win into "not confirmed" too
    strict = spec_from_mapping({"stability": {"bootstrap_resamples": 300}, "freeze": {"margin": 0.4}})
    assert not confirm("w", outcomes(57), PASSED, "b", baseline(36), LABELS, strict).confirmed


def test_a_gate_failed_on_the_sealed_test_blocks_the_freeze():
    failed = GateReport((GateResult("teacher errors", Phase.BASE, False, "0.3", "<= 0.02", "18/60 errors"),))
    c = confirm("w", outcomes(57), failed, "b", baseline(36), LABELS, SPEC)
    assert not c.confirmed and c.reasons == ("sealed-test gate failed: teacher errors: 18/60 errors",)
    lenient = spec_from_mapping({"freeze": {"require_test_gates": False}})
    assert confirm("w", outcomes(57), failed, "b", baseline(36), LABELS, lenient).confirmed


def test_no_labelled_verdict_is_not_a_confirmation():
    c = confirm("w", outcomes(57), PASSED, "b", baseline(36), {}, SPEC)
    assert not c.confirmed and "no labelled verdict" in c.reasons[0]


def test_the_lower_bound_is_deterministic():
    assert objective_lower_bound(outcomes(45), LABELS, ConstraintSpec()) == \
        objective_lower_bound(list(reversed(outcomes(45))), LABELS, ConstraintSpec())
