"""E2E-APE gates, acceptance and selection: bounds (not point estimates) gate, constant teachers fail the kappa
gate, the best feasible candidate wins with ties going to the cheaper, and the non-dominated set."""

import pytest

from eviback.ape.gates import (
    ACCEPTANCE,
    BestFeasible,
    Scored,
    acceptance,
    base_gates,
    canary_gates,
    non_dominated,
    register_acceptance,
    stability_gate,
)
from eviback.ape.measure import compute_metrics
from eviback.ape.records import Condition, ConditionResult, RolloutOutcome, Split
from eviback.ape.spec import ConstraintSpec, SpecError, load_spec, spec_from_mapping
from eviback.teacher.policy import load_policy
from eviback.types import Status

S, I, A = Status.SUFFICIENT, Status.INSUFFICIENT, Status.AMBIGUOUS  # noqa: E741 - the status labels
TWO = load_policy("two-stage")


def outcome(key, status, *, stage_a=None, b=False, tokens=100, violations=0, error=None, leaks=0):
    return RolloutOutcome(key=key, status=status, stage_a_status=stage_a or status, stage_b_ran=b, reward=0.0,
                          error=error, requests=1 + int(b), prompt_tokens=tokens, completion_tokens=0, calls=1,
                          cache_hits=0, schema_violations=violations, gold_leaks=leaks)


def result(condition, outcomes, sample=0, audited=0):
    return ConditionResult("c", Split.VALIDATION, condition, sample, tuple(outcomes), audited_requests=audited)


def metrics(base, *others, spec=None, labels=None):
    labels = labels or {o.key: o.status is S for o in base}
    return compute_metrics(TWO, Split.VALIDATION, [result(Condition.BASE, base), *others], labels,
                           spec or ConstraintSpec())


def alternating(n):
    return [outcome(f"k{i}", S if i % 2 else I) for i in range(n)]


def test_stability_is_judged_on_the_lower_bound_not_the_point_estimate():
    spec = spec_from_mapping({"stability": {"reordered_evidence": {"min_agreement": 0.8, "min_kappa": 0.4}}})
    rule = spec.stability.reordered_evidence
    small = alternating(10)
    m = metrics(small, result(Condition.REORDERED, small), spec=spec)
    gate = stability_gate("reordered_evidence", m.stability_of("reordered_evidence"), rule, spec)
    assert m.stability_of("reordered_evidence").agreement.rate == 1.0
    assert not gate.passed and "lower bound 0.787 < 0.8" in gate.reason  # 10/10 is not enough evidence
    big = alternating(30)
    m = metrics(big, result(Condition.REORDERED, big), spec=spec)
    assert stability_gate("reordered_evidence", m.stability_of("reordered_evidence"), rule, spec).passed


def test_kappa_gate_and_constant_teachers():
    constant = [outcome(f"k{i}", S) for i in range(40)]
    spec = ConstraintSpec()
    m = metrics(constant, result(Condition.PARAPHRASED, constant), labels={f"k{i}": i % 2 == 0 for i in range(40)})
    s = m.stability_of("paraphrased_question")
    assert s.kappa.value is None and s.constant_label == "S"
    gate = stability_gate("paraphrased_question", s, spec.stability.paraphrased_question, spec)
    assert not gate.passed and "constant teacher" in gate.reason
    lenient = spec_from_mapping({"stability": {"constant_teacher": "pass"}})
    assert stability_gate("paraphrased_question", s, lenient.stability.paraphrased_question, lenient).passed
    assert m.sufficiency.balanced_agreement == 0.5  # a constant teacher scores chance, whatever the balance
    # half of the verdicts flip under the perturbation: agreement and kappa both fail
    base = alternating(40)
    flipped = [outcome(o.key, I if o.status is S else S) if i % 2 else o for i, o in enumerate(base)]
    s = metrics(base, result(Condition.PARAPHRASED, flipped)).stability_of("paraphrased_question")
    gate = stability_gate("paraphrased_question", s, spec.stability.paraphrased_question, spec)
    assert not gate.passed and "agreement lower bound" in gate.reason and "kappa lower bound" in gate.reason


def test_repeated_sampling_uses_all_samples():
    base = alternating(30)
    s1 = [outcome(o.key, o.status) for o in base]
    s2 = [outcome(o.key, A) if i < 3 else o for i, o in enumerate(base)]
    m = metrics(base, result(Condition.SAMPLE, s1, 1), result(Condition.SAMPLE, s2, 2))
    s = m.stability_of("repeated_sampling")
    assert s.agreement.successes == 27 and s.agreement.n == 30 and s.kappa.raters == 3
    partial = metrics(base, result(Condition.SAMPLE, s1, 1))  # an interrupted check is not a measurement
    assert partial.stability_of("repeated_sampling") is None


def test_hard_and_cost_gates():
    spec = ConstraintSpec()
    base = alternating(20)
    base[0] = outcome("k0", S, stage_a=I)  # I overturned
    base[1] = outcome("k1", None, error="stage 'A': schema violation", violations=3)
    base[2] = outcome("k2", S, b=True, tokens=90000)
    gates = {g.gate: g for g in base_gates(metrics(base, labels={}), spec)}
    assert not gates["I overturned"].passed
    assert not gates["schema violations"].passed and "1/20" in gates["schema violations"].reason
    assert not gates["teacher errors"].passed
    assert not gates["tokens per rollout"].passed
    assert gates["calls per rollout"].passed and gates["calls per rollout"].value == "1.05"  # B only where it ran
    leak = [outcome(o.key, o.status, leaks=int(i == 0)) for i, o in enumerate(alternating(4))]
    m = metrics(alternating(4), result(Condition.CANARY, leak, audited=4), labels={})
    assert not canary_gates(m, spec)[0].passed and m.boundary.gold_leaks == 1


def test_sufficiency_agreement_with_ambiguous_credit():
    base = [outcome("a", S), outcome("b", A), outcome("c", I), outcome("d", S)]
    labels = {"a": True, "b": True, "c": False, "d": False}
    s = metrics(base, labels=labels).sufficiency
    assert s.on_sufficient == pytest.approx(0.75) and s.on_insufficient == pytest.approx(0.5)
    assert s.balanced_agreement == pytest.approx(0.625) and s.agreement == pytest.approx(2.5 / 4)


def test_selection_best_feasible_ties_to_the_cheaper():
    spec = spec_from_mapping({"objective": {"tie_tolerance": 0.01}})
    scored = [Scored("a", True, 0.80, 900, 1.5, 0.9), Scored("b", True, 0.795, 400, 1.0, 0.9),
              Scored("c", True, 0.70, 100, 1.0, 0.95), Scored("d", False, 0.99, 10, 1.0, 0.99)]
    sel = BestFeasible().select(scored, spec)
    assert sel.winner == "b" and "cheapest" in sel.reason  # within 0.01 of the best, and cheaper
    assert sel.ranking[0] == "b" and "d" not in sel.ranking
    assert BestFeasible().select(scored, ConstraintSpec()).winner == "a"  # no tolerance: the best wins
    assert set(sel.non_dominated) == {"a", "b", "c"}
    assert BestFeasible().select([Scored("x", False, 1.0, 1, 1, 1)], spec).winner is None
    exact = [Scored("p", True, 0.8, 500, 2.0, 0.9), Scored("q", True, 0.8, 300, 1.0, 0.9)]
    assert BestFeasible().select(exact, ConstraintSpec()).winner == "q"


def test_non_dominated():
    pts = [Scored("a", True, 0.8, 100, 1, 0.9), Scored("b", True, 0.7, 200, 1, 0.8), Scored("c", True, 0.9, 300, 1, 0.9)]
    assert non_dominated(pts) == ("a", "c")


def test_acceptance_registry():
    assert set(ACCEPTANCE) >= {"always", "improves-on-feedback"}
    gepa = acceptance("improves-on-feedback")
    assert gepa.accept(0.6, 0.7)[0] is False and gepa.accept(0.7, 0.7)[0] is True
    with pytest.raises(ValueError, match="unknown acceptance"):
        acceptance("greedy")
    with pytest.raises(ValueError, match="already registered"):
        register_acceptance(ACCEPTANCE["always"])


def test_spec_validation_names_the_fix(tmp_path):
    assert load_spec() == ConstraintSpec()
    with pytest.raises(SpecError, match="must be 0"):
        spec_from_mapping({"hard_gates": {"max_stage_a_gold_requests": 1}})
    with pytest.raises(SpecError, match=r"unknown key\(s\) \['min_agrement'\]"):
        spec_from_mapping({"stability": {"reordered_evidence": {"min_agrement": 0.9}}})
    with pytest.raises(SpecError, match="sum to 1"):
        spec_from_mapping({"data": {"train": 0.5, "validation": 0.5, "test": 0.5}})
    path = tmp_path / "s.yaml"
    path.write_text("cost: {max_tokens_per_rollout: 1000}\n")
    assert load_spec(path).cost.max_tokens_per_rollout == 1000.0
    # a value of the wrong type is named with the type it takes, not found later in a comparison
    path.write_text("stability: {reordered_evidence: {min_agreement: high}}\n")
    with pytest.raises(SpecError, match=r"s.yaml.stability.reordered_evidence.min_agreement: setting "
                                        r"'min_agreement' takes a number \(float\), got 'high'"):
        load_spec(path)
    path.write_text("search: {rounds: 2.5}\n")
    with pytest.raises(SpecError, match=r"takes an integer \(int\), got 2.5"):
        load_spec(path)
    path.write_text("hard_gates: {max_error_rate: 1e-3}\n")  # YAML reads 1e-3 as a string
    assert load_spec(path).hard_gates.max_error_rate == 1e-3
