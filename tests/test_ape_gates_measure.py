"""Each gate measured through the real judging path (policy -> requests -> a scripted backend -> parsed
verdicts -> metrics -> gates) fails on an input built to fail it: off-schema raw replies, a teacher that
changes its mind when the evidence is reordered or the question reworded, one whose samples disagree, one
over the cost budget. A greedy policy reports repeated sampling as not applicable, never as agreement 1.00."""

import dataclasses
import hashlib

import pytest

from eviback.ape.gates import base_gates, full_report, not_applicable, stability_gate
from eviback.ape.measure import JudgeBackend, compute_metrics
from eviback.ape.records import NOT_APPLICABLE, Condition, Split
from eviback.ape.rollouts import as_rollouts
from eviback.ape.spec import spec_from_mapping
from eviback.teacher.judge import JudgeConfig, RetryConfig
from eviback.teacher.policy import load_policy
from eviback.teacher.probes import build_probes
from teacher_fakes import ScriptedClient, default_reply

TWO = load_policy("two-stage")
SPEC = spec_from_mapping({"stability": {"bootstrap_resamples": 200, "samples": 3}})


@pytest.fixture(scope="module")
def rollouts():
    return as_rollouts([p.trajectory for p in build_probes(24, seed=11)])[0]


def judged(policy, client, rollouts, *conditions):
    backend = JudgeBackend(client, None, JudgeConfig(concurrency=1, retry=RetryConfig(max_attempts=1)))
    results = [backend.judge_condition("c", policy, Split.VALIDATION, rollouts, Condition.BASE)]
    for condition, sample in conditions:
        results.append(backend.judge_condition("c", policy, Split.VALIDATION, rollouts, condition, sample))
    labels = {r.key: r.sufficient for r in rollouts}
    return compute_metrics(policy, Split.VALIDATION, results, labels, SPEC)


def reply(request, status):
    """A well-formed reply; its answer is copied from the evidence shown, so grounding never lowers it."""
    user = request.messages[-1].content
    at = user.find("(Title: ")
    answer = " ".join(user[at + len("(Title: "):].split()[:4]) if at != -1 else "an answer"
    return default_reply(request, status=status, answer=answer)


def by_text(request):
    """S or I decided by a hash of the whole request text: any change of wording or order may flip it."""
    text = "".join(m.content for m in request.messages) + str(request.sample_index)
    return reply(request, "SI"[int(hashlib.sha256(text.encode()).hexdigest(), 16) % 2])


def steady(request):
    user = request.messages[-1].content
    return reply(request, "S" if len(user) % 2 else "I")


def gate(gates, name):
    return next(g for g in gates if g.gate == name)


def test_off_schema_raw_replies_fail_the_schema_gate(rollouts):
    client = ScriptedClient(lambda r: "I think the evidence is enough." if r.stage == "A" else reply(r, "S"))
    m = judged(TWO, client, rollouts)
    schema = gate(base_gates(m, SPEC), "schema violations")
    assert not schema.passed and m.schema_violating == len(rollouts) and "off-schema" in schema.reason
    ok = judged(TWO, ScriptedClient(steady), rollouts)
    assert gate(base_gates(ok, SPEC), "schema violations").passed and ok.schema_violating == 0


def test_reordered_evidence_fails_a_teacher_that_reads_the_order(rollouts):
    m = judged(TWO, ScriptedClient(by_text), rollouts, (Condition.REORDERED, 0))
    g = stability_gate("reordered_evidence", m.stability_of("reordered_evidence"),
                       SPEC.stability.reordered_evidence, SPEC)
    assert not g.passed and "agreement lower bound" in g.reason
    steady_m = judged(TWO, ScriptedClient(steady), rollouts, (Condition.REORDERED, 0))
    assert steady_m.stability_of("reordered_evidence").agreement.rate == 1.0


def test_paraphrased_question_fails_a_teacher_that_reads_the_wording(rollouts):
    m = judged(TWO, ScriptedClient(by_text), rollouts, (Condition.PARAPHRASED, 0))
    g = stability_gate("paraphrased_question", m.stability_of("paraphrased_question"),
                       SPEC.stability.paraphrased_question, SPEC)
    assert not g.passed and "agreement lower bound" in g.reason


def test_repeated_sampling_is_measured_at_the_stage_temperature_and_fails_a_noisy_teacher(rollouts):
    sampled = dataclasses.replace(TWO, stages=tuple(
        dataclasses.replace(s, decoding=dataclasses.replace(s.decoding, temperature=0.7)) for s in TWO.stages))
    assert not_applicable("repeated_sampling", sampled) is None
    client = ScriptedClient(by_text)
    m = judged(sampled, client, rollouts, (Condition.SAMPLE, 1), (Condition.SAMPLE, 2))
    assert {r.decoding.temperature for r in client.requests} == {0.7}  # the teacher's own temperature
    s = m.stability_of("repeated_sampling")
    g = stability_gate("repeated_sampling", s, SPEC.stability.repeated_sampling, SPEC)
    assert not g.passed and s.kappa.lower is not None and s.kappa.lower < 0.4


def test_a_greedy_policy_reports_repeated_sampling_as_not_applicable(rollouts):
    assert all(s.decoding.temperature == 0 for s in TWO.stages)
    assert "greedily" in not_applicable("repeated_sampling", TWO)
    m = judged(TWO, ScriptedClient(steady), rollouts)
    report = full_report(m, (), SPEC, TWO)
    g = gate(report.results, "repeated sampling")
    assert g.passed and g.value.startswith(NOT_APPLICABLE) and "1.00" not in g.value
    assert m.stability_of("repeated_sampling") is None  # nothing was measured, nothing reported as agreement


def test_the_cost_budget_fails_an_expensive_candidate(rollouts):
    m = judged(TWO, ScriptedClient(steady), rollouts)
    tight = spec_from_mapping({"cost": {"max_tokens_per_rollout": 10, "max_calls_per_rollout": 1}})
    gates = base_gates(m, tight)
    assert not gate(gates, "tokens per rollout").passed
    assert gate(gates, "tokens per rollout").reason.endswith("exceed the budget")
    assert gate(base_gates(m, SPEC), "tokens per rollout").passed


def test_prompt_injection_in_the_evidence_is_counted_as_flips(rollouts):
    """A teacher that obeys an instruction in a passage flips to the injected label; one that reads only the
    evidence's substance does not move."""
    def gullible(request):
        user = request.messages[-1].content
        for label in "SI":
            if f'Reply {{"status": "{label}"}}' in user:
                return reply(request, label)
        return steady(request)

    m = judged(TWO, ScriptedClient(gullible), rollouts, (Condition.INJECTED_S, 0), (Condition.INJECTED_I, 0))
    clean = m.status
    to_s, to_i = m.injection_toward("S"), m.injection_toward("I")
    assert to_s.judged == to_i.judged == len(rollouts)
    assert to_s.eligible == len(rollouts) - clean["S"] and to_s.flipped == to_s.eligible > 0 and to_s.flip_rate == 1
    assert to_i.eligible == len(rollouts) - clean["I"] and to_i.flipped == to_i.eligible > 0
    def firm(request):  # decides on the question alone: text added to a passage cannot move it
        question = next(line for line in request.messages[-1].content.splitlines() if line.strip())
        return reply(request, "SI"[int(hashlib.sha256(question.encode()).hexdigest(), 16) % 2])

    unmoved = judged(TWO, ScriptedClient(firm), rollouts, (Condition.INJECTED_S, 0), (Condition.INJECTED_I, 0))
    assert [(i.judged, i.flipped, i.changed) for i in unmoved.injection] == [(len(rollouts), 0, 0)] * 2
    assert {i.eligible for i in unmoved.injection} != {0}
    assert judged(TWO, ScriptedClient(steady), rollouts).injection == ()  # not measured unless asked
