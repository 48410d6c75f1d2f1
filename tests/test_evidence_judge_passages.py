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
