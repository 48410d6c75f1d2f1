"""A passage judge's reading of the evidence: split into the passages the actor saw, judged one by one,
aggregated into a status (no model: the aggregation and the examples are pure)."""

import pytest

from eviback.protocol import render_observation
from eviback.teacher.evidence_judge import aggregate_status, split_passages
from eviback.teacher.workflow import SeenEvidence
from eviback.train.judge_builder import passage_examples
from eviback.types import Passage, Question, Status

S, A, I = Status.SUFFICIENT, Status.AMBIGUOUS, Status.INSUFFICIENT  # noqa: E741 - the method's labels


def test_evidence_is_split_into_the_passages_as_seen():
    first = render_observation([Passage("1", '"Paris"\nParis is the capital of France.'),
                                Passage("2", '"Lyon"\nLyon is a city.')])
    second = render_observation([Passage("3", '"Seine"\nThe Seine flows through Par')])  # cut mid-word
    evidence = "\n\n".join(o.strip().removeprefix("<information>").removesuffix("</information>").strip()
                           for o in (first, second))
    assert split_passages(evidence) == ['Doc 1(Title: "Paris") Paris is the capital of France.',
                                        'Doc 2(Title: "Lyon") Lyon is a city.',
                                        'Doc 1(Title: "Seine") The Seine flows through Par']
    assert split_passages("") == [] and split_passages("No results.") == ["No results."]
    # a "Doc 3(Title:" inside a passage's text is not a new passage unless it starts a line
    assert len(split_passages('Doc 1(Title: "X") see Doc 3(Title: "Y") here')) == 1


@pytest.mark.parametrize("probs, status", [
    ([], I),
    ([[0.1, 0.1, 0.8], [0.2, 0.1, 0.7]], I),  # no passage more likely relevant than not
    ([[0.1, 0.1, 0.8], [0.7, 0.1, 0.2]], S),  # one passage holds the answer: the others do not matter
    ([[0.3, 0.4, 0.3], [0.1, 0.1, 0.8]], A),  # relevant, but no passage likely holds the answer
])
def test_the_evidence_status_is_the_best_passage_s(probs, status):
    assert aggregate_status(probs) is status
    assert aggregate_status(list(reversed(probs))) is status  # the order of the passages never matters


def test_the_threshold_and_the_allowed_statuses():
    probs = [[0.35, 0.0, 0.65]]
    assert aggregate_status(probs, threshold=0.5) is I and aggregate_status(probs, threshold=0.3) is A
    assert aggregate_status([[0.3, 0.4, 0.3]], allowed=(S, I)) is S  # a binary stage: relevant means S


def test_passage_examples_label_each_passage_with_its_id():
    q = Question("h", "Which band did the singer of Hash Pipe's band later form?", ("The Exies",),
                 dataset="hotpotqa", metadata={"gold_passage_ids": ["10", "11"]})
    text = 'Doc 1(Title: "A") Hash Pipe is a song by Weezer.\nDoc 2(Title: "B") he later formed The Exies.\n' \
           'Doc 3(Title: "C") nothing'
    examples = passage_examples(q, [SeenEvidence(text, ("10", "11", "12"))], "rollout")
    assert [e.label for e in examples] == [A, S, I]
    assert all(e.multi_hop and e.source == "rollout" for e in examples)
    assert examples[1].evidence == 'Doc 2(Title: "B") he later formed The Exies.'


def test_a_question_whose_support_is_named_by_title_gives_a_labels():
    """The FlashRAG-layout release's multi-hop training questions name their supporting passages by title only:
    they are multi-hop examples all the same, and a supporting article's passage without the answer is A."""
    q = Question("t", "Which band did the singer of Hash Pipe's band later form?", ("The Exies",),
                 dataset="hotpotqa", metadata={"supporting_titles": ["Hash Pipe", "Weezer (singer)"]})
    text = 'Doc 1(Title: "Hash Pipe") Hash Pipe is a song by Weezer.\nDoc 2(Title: "Weezer (singer)") he later ' \
           'formed The Exies.\nDoc 3(Title: "Oak") nothing'
    examples = passage_examples(q, [SeenEvidence(text, ("501", "502", "503"))], "search")
    assert [e.label for e in examples] == [A, S, I]
    assert all(e.multi_hop for e in examples)


def _gate_at(scores, closed, threshold):
    """The gate balanced accuracy of calling I below `threshold`, as the held-out figures count it."""
    from eviback.teacher.labels import agreement

    labels = [I if c else S for c in closed]
    return agreement(labels, [aggregate_status([[s, 0.0, 1 - s]], threshold) for s in scores]).gate_balanced_accuracy


def test_the_threshold_is_calibrated_to_the_gate_s_best():
    """Relevant-looking I evidence (a judge whose scores all sit high) needs a threshold above 0.5: the
    calibration finds it, in the middle of the gap that separates the two kinds."""
    from eviback.teacher.evidence_judge import calibrate_threshold

    scores = [0.55, 0.6, 0.62, 0.8, 0.9]
    closed = [True, True, True, False, False]
    c = calibrate_threshold(scores, closed)
    assert c.threshold == pytest.approx(0.71) and c.gate == 1.0 and (c.n_i, c.n_open) == (3, 2)
    assert _gate_at(scores, closed, 0.5) == 0.5 and _gate_at(scores, closed, c.threshold) == 1.0
    assert calibrate_threshold(list(reversed(scores)), list(reversed(closed))) == c  # the order never matters


def test_the_calibrated_gate_is_the_best_any_threshold_reaches():
    """On overlapping scores, no threshold does better than the one chosen, and the reported gate is the one
    the held-out figures would count at it (the same aggregation)."""
    import random

    from eviback.teacher.evidence_judge import calibrate_threshold

    rng = random.Random(3)
    closed = [rng.random() < 0.4 for _ in range(200)]
    scores = [round(min(1.0, max(0.0, rng.gauss(0.55 if c else 0.75, 0.12))), 2) for c in closed]  # ties too
    c = calibrate_threshold(scores, closed)
    assert c.gate == pytest.approx(_gate_at(scores, closed, c.threshold))
    every = {round(t / 200, 3) for t in range(1, 200)}
    assert max(_gate_at(scores, closed, t) for t in every) <= c.gate + 1e-12
    assert c.gate > _gate_at(scores, closed, 0.5)


def test_ties_keep_the_threshold_nearest_the_default_and_nothing_to_calibrate_is_none():
    from eviback.teacher.evidence_judge import calibrate_threshold

    # two thresholds reach the best gate (0.75): below 0.2 and below 0.75; the one nearer the prior is kept
    scores, closed = [0.1, 0.3, 0.6, 0.9], [True, False, True, False]
    assert calibrate_threshold(scores, closed).threshold == pytest.approx(0.75)
    assert calibrate_threshold(scores, closed, prior=0.3).threshold == pytest.approx(0.2)
    assert calibrate_threshold(scores, closed).gate == 0.75
    assert calibrate_threshold([0.2, 0.3], [True, True]) is None  # no not-I evidence
    assert calibrate_threshold([0.4, 0.4], [True, False]) is None  # one score: no threshold splits it
    assert calibrate_threshold([], []) is None
    with pytest.raises(ValueError, match="2 scores but 1 labels"):
        calibrate_threshold([0.1, 0.2], [True])
