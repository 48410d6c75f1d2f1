"""Evidence labels (the yardstick) on hand-made single-hop and multi-hop cases, and agreement figures."""

import pytest

from eviback.protocol import render_observation
from eviback.teacher.labels import (
    agreement,
    evidence_label,
    gate_balanced_accuracy,
    passage_label,
    trajectory_label,
)
from eviback.teacher.workflow import SeenEvidence
from eviback.types import Action, ActionKind, Passage, Question, Status, StopReason, Trajectory, Turn

S, A, I = Status.SUFFICIENT, Status.AMBIGUOUS, Status.INSUFFICIENT  # noqa: E741 - the method's labels


def seen(text, *ids):
    return SeenEvidence(text=text, passage_ids=tuple(ids))


POPQA = Question("p", "What is Marie Curie's occupation?", ("physicist", "chemist"), dataset="popqa",
                 metadata={"gold_passage_ids": ["curie", "physicist-article"]})
NQ = Question("n", "Who discovered X-rays?", ("Wilhelm Conrad Röntgen",), dataset="nq")
HOTPOT = Question("h", "Which band did the singer of Hash Pipe's band later form?", ("The Exies",),
                  dataset="hotpotqa", metadata={"gold_passage_ids": ["10", "11"]})
YES_NO = Question("y", "Are Sutera and Rhodotypos both types of shrub?", ("no",), dataset="hotpotqa",
                  metadata={"gold_passage_ids": ["4147", "4142"]})


@pytest.mark.parametrize("question, evidence, label", [
    # single-hop: the answer alone decides; PopQA's second gold passage (the answer's article) is not needed
    (POPQA, [seen("Doc 1(Title: \"Marie Curie\") Marie Curie was a Polish physicist and chemist.", "curie")], S),
    (POPQA, [seen("Doc 1(Title: \"Marie Curie\") Marie Curie was born in Warsaw.", "curie")], I),
    (NQ, [seen("Doc 1(Title: \"X-ray\") X-rays were discovered by Wilhelm Conrad Röntgen in 1895.")], S),
    (NQ, [seen("Doc 1(Title: \"X-ray\") X-rays were discovered by Wilhelm Conrad")], I),  # cut before the end
    (NQ, [], I),
    # multi-hop: the answer and every supporting passage for S
    (HOTPOT, [seen("Doc 1(Title: \"A\") ... Doc 2(Title: \"B\") he later formed The Exies.", "10", "11")], S),
    (HOTPOT, [seen("Doc 1(Title: \"B\") he later formed The Exies.", "11")], A),  # answer, partial support
    (HOTPOT, [seen("Doc 1(Title: \"A\") Hash Pipe is a song by Weezer.", "10")], A),  # support, no answer
    (HOTPOT, [seen("Doc 1(Title: \"A\") The Exies formed later.", "99")], A),  # the answer, no support
    (HOTPOT, [seen("Doc 1(Title: \"Z\") nothing relevant", "99")], I),
    # yes/no: never a span of the text, so the support stands in for the answer
    (YES_NO, [seen("Doc 1(Title: \"Sutera\") ... Doc 2(Title: \"Rhodotypos\") ...", "4147", "4142")], S),
    (YES_NO, [seen("Doc 1(Title: \"Sutera\") no, not a shrub", "4147")], A),
    (YES_NO, [seen("Doc 1(Title: \"Oak\") no", "1")], I),
])
def test_label_rule(question, evidence, label):
    assert evidence_label(question, evidence) is label


def test_the_label_of_a_rollout_uses_the_evidence_as_the_actor_saw_it():
    passage = Passage("x", '"X-ray"\nX-rays were discovered by Wilhelm Conrad Röntgen in 1895.')
    full = render_observation((passage,))

    def rollout(observation):
        turn = Turn("<search> x-rays </search>", Action(ActionKind.SEARCH, "x-rays"), (passage,), observation, True)
        return Trajectory(NQ, (turn,), None, StopReason.FORCED)
    assert trajectory_label(rollout(full)) is S
    assert trajectory_label(rollout(full[: full.index("Röntgen")])) is I


def test_agreement_figures():
    labels = [S, S, I, I, A, A]
    perfect = agreement(labels, labels)
    assert perfect.accuracy == perfect.balanced_accuracy == perfect.kappa == perfect.s_vs_i_balanced_accuracy == 1
    always_s = agreement(labels, [S] * 6)
    assert always_s.balanced_accuracy == pytest.approx(1 / 3) and always_s.kappa == 0
    assert always_s.s_vs_i_balanced_accuracy == 0.5 and always_s.confusion["I"]["S"] == 2
    mixed = agreement([S, S, I, I], [S, I, I, I])
    assert mixed.s_vs_i_balanced_accuracy == pytest.approx(0.75) and mixed.kappa == pytest.approx(0.5)
    with pytest.raises(ValueError):
        agreement([S], [])


def test_the_gate_metric_scores_i_against_not_i():
    """Stage A is a gate: A opens Stage B as S does. "S vs I" counted a predicted A on I evidence as a correct
    rejection; the gate metric does not."""
    labels = [S, S, A, A, I, I]
    never_closes = agreement(labels, [S, S, A, A, A, A])
    assert never_closes.s_vs_i_balanced_accuracy == 1.0  # the old figure: A on I is "not S", so it looks perfect
    assert never_closes.gate_balanced_accuracy == 0.5  # but it never closes the gate
    assert agreement(labels, [S, A, S, A, I, I]).gate_balanced_accuracy == 1.0  # S/A confusions do not matter
    assert agreement(labels, [I, S, S, S, I, S]).gate_balanced_accuracy == pytest.approx((3 / 4 + 1 / 2) / 2)
    assert agreement([S, S], [S, I]).gate_balanced_accuracy is None  # no I label: undefined, not 0 or 1
    # from the counts a training run logs per step (teacher/gate_*), summed: the same figure
    assert gate_balanced_accuracy(label_i=2, closed_on_i=1, label_open=4, open_on_open=3) == pytest.approx(
        agreement(labels, [I, S, S, S, I, S]).gate_balanced_accuracy)
    assert gate_balanced_accuracy(label_i=0, closed_on_i=0, label_open=3, open_on_open=3) is None


@pytest.mark.parametrize("question, text, pid, label", [
    (NQ, "Doc 1(Title: \"X-ray\") X-rays were discovered by Wilhelm Conrad Röntgen in 1895.", None, S),
    (NQ, "Doc 2(Title: \"X-ray\") X-rays were discovered by Wilhelm Conrad", None, I),  # cut before the answer
    (POPQA, "Doc 1(Title: \"Marie Curie\") Marie Curie was born in Warsaw.", "curie", I),  # single-hop: no A
    (HOTPOT, "Doc 1(Title: \"B\") he later formed The Exies.", "11", S),
    (HOTPOT, "Doc 1(Title: \"A\") Hash Pipe is a song by Weezer.", "10", A),  # support without the answer
    (HOTPOT, "Doc 1(Title: \"Z\") nothing relevant", "99", I),
    (YES_NO, "Doc 1(Title: \"Sutera\") Sutera is a genus of ... no ...", "4147", A),  # yes/no: never S
    (YES_NO, "Doc 1(Title: \"Elm\") no shrub here", "1", I),
])
def test_passage_label(question, text, pid, label):
    assert passage_label(question, text, pid) is label


def test_the_evidence_is_i_exactly_when_every_passage_is_i():
    blocks = ["Doc 1(Title: \"X-ray\") Rays of short wavelength.",
              "Doc 2(Title: \"Röntgen\") Wilhelm Conrad Röntgen discovered them in 1895."]
    for chosen in ([blocks[0]], [blocks[1]], blocks):
        text = "\n".join(chosen)
        whole = evidence_label(NQ, [seen(text)])
        parts = [passage_label(NQ, b) for b in chosen]
        assert (whole is I) == all(p is I for p in parts)


# The FlashRAG-layout data release names the supporting passages of its multi-hop *training* questions by
# title only (`supporting_titles`, no `gold_passage_ids`): they are multi-hop all the same, with the corpus
# passages of those titles as their support.
BY_TITLE = Question("t", "Which band did the singer of Hash Pipe's band later form?", ("The Exies",),
                    dataset="hotpotqa", metadata={"supporting_titles": ["Hash Pipe", "Weezer (singer)"]})
HASH_PIPE = 'Doc 1(Title: "Hash Pipe") Hash Pipe is a song by Weezer.'
SINGER = 'Doc 2(Title: "Weezer (singer)") he later formed The Exies.'


@pytest.mark.parametrize("evidence, label", [
    ([seen(f"{HASH_PIPE}\n{SINGER}", "501", "502")], S),  # every supporting title seen, and the answer
    ([seen(HASH_PIPE, "501"), seen(SINGER.replace("Doc 2", "Doc 1"), "502")], S),  # over two searches
    ([seen(SINGER, "502")], A),  # the answer, one supporting title
    ([seen(HASH_PIPE, "501")], A),  # a supporting passage without the answer
    ([seen('Doc 1(Title: "Hash Pipe (film)") The Exies were there.', "9")], A),  # the answer, no support
    ([seen('Doc 1(Title: "Oak") nothing relevant', "9")], I),
    ([seen('Doc 1(Title: "Oak") a text naming Hash Pipe', "9")], I),  # a title in the text is not a header
])
def test_support_named_by_title(evidence, label):
    assert evidence_label(BY_TITLE, evidence) is label


def test_passage_label_of_support_named_by_title():
    from eviback.teacher.labels import is_multi_hop

    assert is_multi_hop(BY_TITLE) and not is_multi_hop(NQ)
    assert passage_label(BY_TITLE, HASH_PIPE, "501") is A  # the supporting article's passage: A by its title
    assert passage_label(BY_TITLE, SINGER, "502") is S
    assert passage_label(BY_TITLE, 'Doc 3(Title: "Oak") Hash Pipe', "9") is I
    # ids, where a question has them, decide: another paragraph of a supporting article is not support
    both = Question("b", BY_TITLE.question, BY_TITLE.golden_answers, dataset="musique",
                    metadata={"supporting_titles": ["Hash Pipe"], "gold_passage_ids": ["501"]})
    assert passage_label(both, HASH_PIPE, "501") is A and passage_label(both, HASH_PIPE, "777") is I


def test_the_oracle_reads_support_named_by_title():
    """The evidence-label rule stage (the oracle's Stage A) gets the titles in its gold payload."""
    import json

    from eviback.teacher import load_policy
    from eviback.teacher.rules import label_reply
    from eviback.teacher.workflow import blind_view, rule_request

    passages = (Passage("501", '"Hash Pipe"\nHash Pipe is a song by Weezer.'),
                Passage("502", '"Weezer (singer)"\nhe later formed The Exies.'))
    turn = Turn("<search> hash pipe </search>", Action(ActionKind.SEARCH, "hash pipe"), passages,
                render_observation(passages), True)
    rollout = Trajectory(BY_TITLE, (turn,), None, StopReason.FORCED)
    stage = load_policy("oracle").status_stage
    payload = json.loads(rule_request(stage, blind_view(rollout), BY_TITLE).messages[0].content)
    assert payload["gold"]["supporting_titles"] == ["Hash Pipe", "Weezer (singer)"]
    assert label_reply(payload, {}) == {"status": "S"} and trajectory_label(rollout) is S
