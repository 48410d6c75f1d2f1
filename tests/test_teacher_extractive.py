"""The extractive, gold-aware Stage B: spans of the evidence as the actor saw it, their bounds, tie-breaking,
I when nothing matches; the rule as a stage backend of a frozen policy; the teacher that runs it."""

import dataclasses
import json

import pytest

from eviback.metrics import f1_score
from eviback.protocol import render_observation
from eviback.teacher.boundary import CanaryAudit, plant_canaries
from eviback.teacher.cache import MemoryCache
from eviback.teacher.extractive import best_span
from eviback.teacher.judge import JudgeConfig, Teacher
from eviback.teacher.policy import (
    EXTRACTIVE_SPAN,
    Input,
    OutputField,
    PolicyError,
    StageSpec,
    TeacherPolicy,
    artifact_json,
    load_policy,
    parse_artifact,
    parse_rule_backend,
)
from eviback.teacher.rules import RuleClient
from eviback.teacher.workflow import stage_request
from eviback.types import Action, ActionKind, Passage, Question, Status, StopReason, Trajectory, Turn
from teacher_fakes import ScriptedClient

S, I, A = Status.SUFFICIENT, Status.INSUFFICIENT, Status.AMBIGUOUS  # noqa: E741 - the method's labels
EXTRACTIVE = load_policy("two-stage-extractive")
EIFFEL = Passage("p1", '"Eiffel Tower"\nThe Eiffel Tower was designed by the engineering company of Gustave '
                       'Eiffel and completed in 1889 for the World\'s Fair in Paris, France.')
LOUVRE = Passage("p2", '"Louvre"\nThe Louvre is the world\'s most-visited museum, and a historic landmark in '
                       'Paris, France. It is home to the Mona Lisa, painted by Leonardo da Vinci.')


def rollout(golds=("1889",), observation=None, passages=(EIFFEL, LOUVRE), answer="1900"):
    question = Question("q", "When was the Eiffel Tower completed?", tuple(golds))
    obs = render_observation(passages) if observation is None else observation
    turns = (Turn("<search> Eiffel Tower </search>", Action(ActionKind.SEARCH, "Eiffel Tower"), passages, obs, True),
             Turn(f"<answer> {answer} </answer>", Action(ActionKind.ANSWER, answer)))
    return Trajectory(question, turns, answer, StopReason.ANSWERED)


# --------------------------------------------------------------------------------------------------
# The span search


@pytest.mark.parametrize("golds, evidence, text, f1", [
    (("1889",), "completed in 1889 for the World's Fair", "1889", 1.0),
    (("Gustave Eiffel",), "the engineering company of Gustave Eiffel, and", "Gustave Eiffel", 1.0),
    # the surface words, without the punctuation around them; case and articles as written
    (("Eiffel Tower",), 'Doc 1(Title: "Eiffel Tower") The Eiffel', "Eiffel Tower", 1.0),
    (("The Eiffel Tower",), "the Eiffel Tower was designed", "Eiffel Tower", 1.0),
    # partial matches: the best F1, "Paris" against "Paris, Texas" is 2/3
    (("Paris, Texas",), "a landmark in Paris, France", "Paris", 2 / 3),
    # two gold answers: the max over them
    (("Lutetia", "Paris"), "a landmark in Paris, France", "Paris", 1.0),
])
def test_the_best_span_is_whole_words_of_the_evidence_with_the_highest_f1(golds, evidence, text, f1):
    span = best_span(evidence, golds)
    assert span is not None and span.text == text and span.f1 == pytest.approx(f1)
    assert span.f1 == pytest.approx(f1_score(span.text, golds))  # the project's F1, on the text returned


@pytest.mark.parametrize("golds, evidence", [
    (("1889",), "completed in 1890 for the World's Fair"),  # the gold is not in the evidence
    (("ten",), "it happens often"),  # whole words only
    (("10",), "ten years later"),  # no number normalisation
    (("Tower of London",), "the city of Paris"),  # "of" is shared, but no content word
    (("the",), "the Eiffel Tower"),  # a gold with no content word never matches
    (("1889",), ""),
])
def test_no_span_with_f1_above_zero_gives_none(golds, evidence):
    assert best_span(evidence, golds) is None


def test_spans_are_bounded_in_words():
    gold = "the engineering company of Gustave Eiffel and completed in 1889"
    evidence = "The Eiffel Tower was designed by the engineering company of Gustave Eiffel and completed in 1889."
    long = best_span(evidence, (gold,), max_words=20)
    assert long.text == "engineering company of Gustave Eiffel and completed in 1889" and long.f1 == 1.0
    for bound in (1, 3, 8):
        span = best_span(evidence, (gold,), max_words=bound)
        assert span.words <= bound and len(span.text.split()) <= bound
        assert 0 < span.f1 < 1.0
    with pytest.raises(ValueError, match="max_words"):
        best_span(evidence, (gold,), max_words=0)


def test_ties_go_to_fewer_words_then_to_the_earliest_span():
    # "Eiffel", "Gustave" and "Eiffel designed it. Gustave" all score 2/3 against "Gustave Eiffel"
    span = best_span("Eiffel designed it. Gustave was his first name.", ("Gustave Eiffel",))
    assert span.text == "Eiffel" and span.start == 0 and span.f1 == pytest.approx(2 / 3)
    assert best_span("Gustave designed it. Eiffel was his name.", ("Gustave Eiffel",)).text == "Gustave"
    # a whole match beats a shorter partial one
    assert best_span("Eiffel, then Gustave Eiffel.", ("Gustave Eiffel",)).text == "Gustave Eiffel"


def test_a_span_never_crosses_a_line_so_never_joins_two_passages():
    evidence = "Doc 1(Title: x) designed by Gustave\nEiffel came later"
    span = best_span(evidence, ("Gustave Eiffel",))
    assert span.text == "Gustave" and span.f1 == pytest.approx(2 / 3)
    assert best_span(evidence.replace("\n", " "), ("Gustave Eiffel",)).text == "Gustave Eiffel"


def test_a_long_evidence_is_searched_quickly():
    import time

    words = ("the tower of the city was built in the year of our lord and then " * 300).split()  # 4,800 words
    evidence = " ".join(words) + " Tower of London"
    start = time.perf_counter()
    span = best_span(evidence, ("Tower of London",))
    assert span.text == "Tower of London" and span.f1 == 1.0
    assert time.perf_counter() - start < 2.0  # about 0.05 s on one core


# --------------------------------------------------------------------------------------------------
# The rule as a stage backend


def test_the_extractive_backend_is_part_of_the_frozen_policy_and_its_version():
    b = EXTRACTIVE.stages[1]
    assert b.backend == f"{EXTRACTIVE_SPAN}:max_words=8" and b.is_rule and b.own_backend and not b.is_classifier
    assert parse_rule_backend(b.backend) == (EXTRACTIVE_SPAN, {"max_words": 8})
    assert EXTRACTIVE.boundary_violations() == () and EXTRACTIVE.needs_llm  # Stage A is still a prompt
    longer = dataclasses.replace(EXTRACTIVE, stages=(EXTRACTIVE.stages[0],
                                                     dataclasses.replace(b, backend=f"{EXTRACTIVE_SPAN}:max_words=12")))
    assert longer.version != EXTRACTIVE.version
    artifact = parse_artifact(artifact_json(longer))
    assert artifact.policy == longer and artifact.version == longer.version
    edited = artifact_json(longer).replace("max_words=12", "max_words=13")
    with pytest.raises(PolicyError, match="edited"):
        parse_artifact(edited)


@pytest.mark.parametrize("change, message", [
    (dict(backend="extractive-span:max_words=0"), "integer >= 1"),
    (dict(backend="extractive-span:words=8"), "not a parameter"),
    (dict(backend="nearest-neighbour"), "neither a classifier"),
    (dict(user_template="Evidence: $evidence"), "no prompt"),
    (dict(outputs=(OutputField.STATUS,)), "outputs"),
    (dict(sees=(Input.QUESTION, Input.EVIDENCE, Input.GOLD)), "sees"),
    (dict(statuses=(S, A, I)), "statuses"),
])
def test_a_malformed_rule_stage_is_refused_naming_the_fix(change, message):
    b = EXTRACTIVE.stages[1]
    with pytest.raises(PolicyError, match=message):
        dataclasses.replace(EXTRACTIVE, stages=(EXTRACTIVE.stages[0], dataclasses.replace(b, **change)))


def test_the_extractive_rule_cannot_decide_the_status():
    b = EXTRACTIVE.stages[1]
    with pytest.raises(PolicyError, match="cannot be the first stage"):
        TeacherPolicy(name="x", stages=(dataclasses.replace(b, run_on=()),))


def test_the_rule_reads_the_evidence_as_the_actor_saw_it_not_the_whole_passages():
    full = render_observation((EIFFEL, LOUVRE))
    cut = full[: full.index("1889")]  # the actor's observation was cut before the year
    client = RuleClient(EXTRACTIVE.stages[1].backend)
    request = stage_request(EXTRACTIVE.stages[1], rollout(observation=cut))
    payload = json.loads(request.messages[-1].content)
    assert set(payload) == {"evidence", "gold"} and payload["gold"]["answers"] == ["1889"]
    assert "1889" not in json.dumps(payload["evidence"]) and "completed in" in payload["evidence"][0]["text"]
    assert json.loads(client.complete(request).text) == {"status": "I", "answer": ""}
    # the uncut rollout has it
    request = stage_request(EXTRACTIVE.stages[1], rollout())
    assert json.loads(client.complete(request).text) == {"status": "S", "answer": "1889"}


def scripted_stage_a(status):
    return ScriptedClient(lambda request: json.dumps({"status": status}))


@pytest.mark.parametrize("stage_a, golds, final, answer, reward", [
    ("S", ("1889",), S, "1889", 1.0),
    ("A", ("1889",), A, "1889", 0.5),  # Stage B keeps A: it never raises a verdict
    ("S", ("Gustave Eiffel",), S, "Gustave Eiffel", 1.0),
    ("S", ("completed 1889",), S, "completed in 1889", 0.8),  # "in" costs precision: 2/3, recall 1
    ("S", ("The Exies",), I, "", 0.0),  # the gold is nowhere in the evidence: I
    ("I", ("1889",), I, "1900", 0.0),  # Stage B never runs after I
])
def test_a_teacher_with_the_extractive_stage_b(stage_a, golds, final, answer, reward):
    client = scripted_stage_a(stage_a)
    cache = MemoryCache()
    with Teacher(EXTRACTIVE, client, JudgeConfig(concurrency=1), cache=cache) as teacher:
        verdict = teacher.judge_one(rollout(golds=golds))
        stats = teacher.stats()
    assert verdict.status is final and verdict.answer == answer
    assert verdict.reward == pytest.approx(reward)
    assert not verdict.ungrounded  # a span of the evidence is grounded by construction
    assert [r.stage for r in client.requests] == ["A"]  # the LLM answers Stage A only
    assert verdict.stage_b_ran is (stage_a != "I")
    if stage_a != "I":
        assert stats.by_stage["B"].requests == 1 and stats.by_stage["B"].cache_hits == 0
    assert len(cache) == 1  # Stage A's reply only: rule replies are not cached


def test_the_extractive_stage_keeps_stage_a_gold_blind():
    t = rollout(golds=("1889",))
    planted, canaries = plant_canaries([t, rollout(golds=("Gustave Eiffel",))], seed=3)
    audit = CanaryAudit(EXTRACTIVE, canaries)
    with Teacher(EXTRACTIVE, scripted_stage_a("S"), JudgeConfig(concurrency=1), on_request=audit) as teacher:
        verdicts = teacher.judge(planted)
    assert audit.leaks == [] and audit.checked == 2
    # Stage B saw the gold (canaries included) and still answered from the evidence only
    assert [v.answer for v in verdicts] == ["1889", "Gustave Eiffel"]


def test_a_rule_stage_b_is_not_an_llm_stage():
    stage = EXTRACTIVE.stages[1]
    assert isinstance(stage, StageSpec) and stage.deterministic and stage.system_prompt == stage.user_template == ""
