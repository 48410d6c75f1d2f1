"""Evidence as the actor saw it, and the grounding of the refined answer, on real strings."""

import dataclasses

import pytest

from eviback.protocol import render_observation
from eviback.teacher.answers import is_non_answer
from eviback.teacher.policy import artifact_json, load_policy, parse_artifact, policy_from_json
from eviback.teacher.workflow import (
    StageOutcome,
    StageOutput,
    answer_grounded,
    answer_in_evidence,
    blind_view,
    evidence_as_seen,
    run_workflow,
    stage_request,
)
from eviback.types import Action, ActionKind, Passage, Question, Status, StopReason, Trajectory, Turn

TWO = load_policy("two-stage")
EIFFEL = Passage("p1", '"Eiffel Tower"\nThe Eiffel Tower was designed by the engineering company of Gustave '
                       'Eiffel and completed in 1889 for the World\'s Fair in Paris, France.')
LOUVRE = Passage("p2", '"Louvre"\nThe Louvre is the world\'s most-visited museum, and a historic landmark in '
                       'Paris, France. It is home to the Mona Lisa, painted by Leonardo da Vinci.')


def rollout(observation: str | None = None, golds=("1889",), answer="1900", passages=(EIFFEL, LOUVRE)):
    question = Question("q", "When was the Eiffel Tower completed?", golds)
    obs = render_observation(passages) if observation is None else observation
    turns = (Turn("<search> Eiffel Tower </search>", Action(ActionKind.SEARCH, "Eiffel Tower"), passages, obs, True),
             Turn(f"<answer> {answer} </answer>", Action(ActionKind.ANSWER, answer)))
    return Trajectory(question, turns, answer, StopReason.ANSWERED)


def test_a_passage_cut_in_the_observation_is_cut_the_same_way_in_the_stage_a_request():
    full = render_observation((EIFFEL, LOUVRE))
    cut = full[: full.index("Mona Lisa")]  # what a max_observation_tokens cut leaves: no closing tag
    request = stage_request(TWO.stages[0], rollout(observation=cut))
    sent = request.messages[-1].content
    assert "It is home to the" in sent and "Mona Lisa" not in sent and "Leonardo" not in sent
    assert "<information>" not in sent and "</information>" not in sent
    # the uncut rollout sends the whole passage
    assert "Leonardo da Vinci" in stage_request(TWO.stages[0], rollout()).messages[-1].content


def test_a_passage_cut_away_entirely_was_not_seen():
    full = render_observation((EIFFEL, LOUVRE))
    cut = full[: full.index("Doc 2(")]
    (seen,) = evidence_as_seen(rollout(observation=cut))
    assert seen.passage_ids == ("p1",) and "Louvre" not in seen.text
    assert blind_view(rollout(observation=cut)).evidence == (EIFFEL, LOUVRE)  # retrieved, for identification


def test_a_repeated_search_adds_its_result_once():
    t = rollout()
    t = dataclasses.replace(t, turns=(t.turns[0], t.turns[0], t.turns[1]))
    assert len(evidence_as_seen(t)) == 1


@pytest.mark.parametrize("answer, evidence, found", [
    ("1889", "completed in 1889 for the World's Fair", True),
    ("Gustave Eiffel", "the engineering company of Gustave Eiffel and", True),
    ("The Eiffel Tower", "eiffel tower was designed", True),  # SQuAD normalisation: case, article
    ("ten", "it happens often", False),  # whole words only
    ("10", "ten years later", False),  # digits are not words: "10" is not found in "ten"
    ("ten", "10 years later", False),
    ("yes", "Sutera is a genus of flowering plants", False),  # a yes/no answer is never a span of the text
    ("", "anything", False),
    ("A+", "blood of type A+ is", True),  # SQuAD normalisation empties "A+": its plain form is looked for
    ("A+", "blood of type AB+ is", False),
    ("...", "the text", False),  # an answer that normalises to nothing is never found as the empty string
])
def test_answer_in_evidence(answer, evidence, found):
    assert answer_in_evidence(answer, evidence) is found


def scripted(stage_b_answer, stage_a="S"):
    def call(request):
        if request.stage == "A":
            return StageOutcome(StageOutput(status=Status(stage_a)), calls=1)
        return StageOutcome(StageOutput(status=Status.SUFFICIENT, answer=stage_b_answer), calls=1)
    return call


def test_gold_present_in_the_evidence_earns_credit():
    verdict = run_workflow(TWO, rollout(), scripted("1889"))
    assert verdict.status is Status.SUFFICIENT and not verdict.ungrounded and verdict.reward == 1.0


def test_gold_absent_from_the_evidence_gives_i():
    # the gold answer was retrieved but cut from what the actor saw: Stage B cannot ground it
    full = render_observation((EIFFEL, LOUVRE))
    cut = full[: full.index("1889")]
    verdict = run_workflow(TWO, rollout(observation=cut), scripted("1889"))
    assert verdict.status is Status.INSUFFICIENT and verdict.ungrounded and verdict.reward == 0.0
    assert verdict.stage_a_status is Status.SUFFICIENT
    # an answer Stage B copied from the gold of another world is refused too
    verdict = run_workflow(TWO, rollout(golds=("The Exies",)), scripted("The Exies"))
    assert verdict.ungrounded and verdict.reward == 0.0


def test_grounding_can_be_turned_off_explicitly_and_is_part_of_the_version():
    loose = dataclasses.replace(TWO, grounded_answer=False)
    assert loose.version != TWO.version and TWO.grounded_answer
    full = render_observation((EIFFEL, LOUVRE))
    verdict = run_workflow(loose, rollout(observation=full[: full.index("1889")]), scripted("1889"))
    assert verdict.status is Status.SUFFICIENT and not verdict.ungrounded and verdict.reward == 1.0


def test_an_artifact_frozen_before_grounding_keeps_its_version_and_its_behaviour():
    loose = dataclasses.replace(TWO, grounded_answer=False)
    text = artifact_json(loose)
    assert "grounded_answer" not in text  # what an artifact of an older eviback looks like
    artifact = parse_artifact(text)
    assert artifact.policy == loose and artifact.version == loose.version
    assert policy_from_json(TWO.canonical_json()) == TWO


# --------------------------------------------------------------------------------------------------
# The non-answer rule: strings Stage B wrote in real runs, which occur in almost any evidence

# Evidence in which each of those strings occurs as whole normalised words: "I" (World War I), "S"
# (Harry S. Truman), "of", "the".
WAR = Passage("p3", '"Harry S. Truman"\nHarry S. Truman served in France during World War I... He was the '
                    'president of the United States from 1945.')


@pytest.mark.parametrize("answer", ["...", "…", "S", "I", "...I", "A.", "the", "of the", "", "  ", "(S)",
                                    "insufficient", "of the I"])
def test_non_answers_are_never_grounded(answer):
    assert is_non_answer(answer)
    assert not answer_grounded(answer, render_observation((WAR,)))


@pytest.mark.parametrize("answer", ["Truman", "1945", "World War I", "the United States", "U.S.", "yes", "no"])
def test_answers_with_a_content_word_are_answers(answer):
    assert not is_non_answer(answer)


def test_the_status_letter_i_is_in_the_evidence_but_not_grounded():
    evidence = render_observation((WAR,))
    assert answer_in_evidence("I", evidence) and answer_in_evidence("of the", evidence)  # containment alone
    assert not answer_grounded("I", evidence) and not answer_grounded("of the", evidence)
    assert answer_grounded("World War I", evidence) and answer_grounded("Truman", evidence)


@pytest.mark.parametrize("answer", ["...", "S", "I", "...I", "A.", "the", "of the", ""])
def test_a_non_answer_written_by_stage_b_lowers_the_verdict_to_i(answer):
    t = rollout(golds=("Harry S. Truman",), answer="Truman", passages=(WAR,))
    verdict = run_workflow(TWO, t, scripted(answer))
    assert verdict.status is Status.INSUFFICIENT and verdict.ungrounded and verdict.reward == 0.0
    assert verdict.stage_a_status is Status.SUFFICIENT
    # the same rollout with a real answer from the evidence keeps its status and earns credit
    verdict = run_workflow(TWO, t, scripted("Harry S. Truman"))
    assert verdict.status is Status.SUFFICIENT and not verdict.ungrounded and verdict.reward == 1.0


@pytest.mark.parametrize("answer", ["May", "Will", "Can", "The Who", "1"])
def test_words_that_are_also_names_or_months_stay_answers(answer):
    assert not is_non_answer(answer)
