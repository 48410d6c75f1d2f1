"""E2E-APE data: the actor's rollouts on training questions only (evaluation questions refused), labelled by
the evidence labeller, never carrying another question's gold; the deterministic, disjoint split by question;
the sealed test split; perturbations."""

import dataclasses
import json
import random

import pytest

from eviback.ape.config import ApeConfig
from eviback.ape.data import load_data, refuse_eval_questions
from eviback.ape.records import Split
from eviback.ape.rollouts import (
    SealedError,
    SealedSplit,
    as_rollouts,
    evidence_label,
    keep_all_zero,
    paraphrase_question,
    read_dump,
    reorder_evidence,
    reword,
    split_of,
    split_rollouts,
    subset,
    sufficiency_label,
)
from eviback.ape.spec import ConstraintSpec, spec_from_mapping
from eviback.data import write_jsonl
from eviback.teacher.labels import trajectory_label
from eviback.teacher.probes import build_probes
from eviback.teacher.workflow import blind_view
from eviback.types import Status, to_dict


@pytest.fixture(scope="module")
def probes():
    return build_probes(60, seed=5, source="train")


def test_labels_are_the_evidence_labeller_s(probes):
    rollouts, _ = as_rollouts([p.trajectory for p in probes])
    for r in rollouts:
        label = trajectory_label(r.trajectory)
        assert r.label is label and evidence_label(r.trajectory) is label
        assert r.sufficient is {Status.SUFFICIENT: True, Status.INSUFFICIENT: False}.get(label)
        assert sufficiency_label(r.trajectory) is r.sufficient
    assert {r.label for r in rollouts} >= {Status.SUFFICIENT, Status.INSUFFICIENT}


def test_evaluation_questions_are_refused(tmp_path, probes):
    train = tmp_path / "train.jsonl"
    write_jsonl(train, (to_dict(p.trajectory) for p in probes))
    splits, inputs, _ = load_data(ApeConfig(out=str(tmp_path / "run"), dumps=(str(train),)),
                                  spec_from_mapping({"objective": {"min_labelled": 1}}))
    assert splits.infos()[0].rollouts > 0 and inputs[0].startswith(f"dump {train}")
    benchmark = build_probes(6, seed=1)  # the evaluation files' questions
    evals = tmp_path / "eval.jsonl"
    write_jsonl(evals, (to_dict(p.trajectory) for p in [*(p for p in probes), *benchmark]))
    with pytest.raises(ValueError, match="evaluation questions of the data suite"):
        load_data(ApeConfig(out=str(tmp_path / "run2"), dumps=(str(evals),)), ConstraintSpec())
    # a reworded id does not hide an evaluation question: its text is matched too
    t = benchmark[0].trajectory
    renamed = dataclasses.replace(t, question=dataclasses.replace(t.question, id="renamed-1"))
    with pytest.raises(ValueError, match="training questions only"):
        refuse_eval_questions([renamed], None)


def test_no_probe_carries_another_question_s_gold(probes):
    for source in ("train", "eval"):
        built = probes if source == "train" else build_probes(60, seed=5)
        golds = {p.trajectory.question.id: set(p.trajectory.question.golden_answers) for p in built}
        for p in built:
            others = set().union(*(g for qid, g in golds.items() if qid != p.trajectory.question.id))
            others -= set(p.trajectory.question.golden_answers)
            assert p.trajectory.answer is None or p.trajectory.answer not in others


def test_split_is_deterministic_disjoint_and_order_independent(probes):
    rollouts, dropped = as_rollouts([p.trajectory for p in probes])
    assert dropped == 0 and len(rollouts) == 60
    a = split_rollouts(rollouts, salt="s", train=0.5, validation=0.25)
    shuffled = list(rollouts)
    random.Random(1).shuffle(shuffled)
    b = split_rollouts(shuffled, salt="s", train=0.5, validation=0.25)
    assert a.infos() == b.infos()  # same hashes whatever the input order
    test = a.test.unseal("selection@1")
    qids = [{r.question_id for r in part} for part in (a.train, a.validation, test)]
    assert not (qids[0] & qids[1]) and not (qids[0] & qids[2]) and not (qids[1] & qids[2])
    assert sum(i.rollouts for i in a.infos()) == 60 and all(i.rollouts > 0 for i in a.infos())
    for r in rollouts:  # every rollout of a question is in that question's split
        assert split_of(r.question_id, "s", 0.5, 0.25) in {Split.TRAIN, Split.VALIDATION, Split.TEST}
    c = split_rollouts(rollouts, salt="other", train=0.5, validation=0.25)
    assert c.infos()[0].sha256 != a.infos()[0].sha256  # another salt is another split
    # a second rollout of a known question follows it into the same split
    extra = dataclasses.replace(rollouts[0].trajectory, sample_index=4, answer="another answer")
    more, _ = as_rollouts([*(r.trajectory for r in rollouts), extra])
    d = split_rollouts(more, salt="s", train=0.5, validation=0.25)
    home = [part for part in (d.train, d.validation, d.test.unseal("x")) if any(
        r.question_id == rollouts[0].question_id for r in part)]
    assert len(home) == 1 and sum(r.question_id == rollouts[0].question_id for r in home[0]) == 2


def test_sealed_split_opens_for_one_selection_only(probes):
    rollouts, _ = as_rollouts([p.trajectory for p in probes[:10]])
    sealed = SealedSplit(rollouts)
    assert len(sealed) == 10 and sealed.info.rollouts == 10
    with pytest.raises(SealedError):
        sealed.unseal("")
    assert sealed.unseal("selection@7") == sealed.unseal("selection@7")  # a resumed run re-reads it
    with pytest.raises(SealedError, match="already read"):
        sealed.unseal("selection@8")


def test_subset_is_deterministic(probes):
    rollouts, _ = as_rollouts([p.trajectory for p in probes])
    a = subset(rollouts, 10, "x")
    assert a == subset(list(reversed(rollouts)), 10, "x") and len(a) == 10
    assert subset(rollouts, 100, "x") == tuple(sorted(rollouts, key=lambda r: r.key))


def test_reordered_evidence_keeps_the_passages_in_another_order(probes):
    for p in probes[:10]:
        t = p.trajectory
        r = reorder_evidence(t, "salt")
        before, after = blind_view(t).evidence, blind_view(r).evidence
        assert sorted(x.id for x in before) == sorted(x.id for x in after)
        assert [x.id for x in before] != [x.id for x in after]
        assert sufficiency_label(r) == sufficiency_label(t)
        assert r.evidence[0].contents.split("\n")[0].strip('"') in r.turns[0].observation
    single = dataclasses.replace(probes[0].trajectory.turns[0], passages=probes[0].trajectory.turns[0].passages[:1])
    t1 = dataclasses.replace(probes[0].trajectory, turns=(single,) + probes[0].trajectory.turns[1:])
    assert reorder_evidence(t1) is None  # one passage has no other order: not counted


def test_paraphrases_reword_and_given_paraphrases_win(probes):
    t = probes[0].trajectory
    p = paraphrase_question(t)
    assert p.question.question != t.question.question and p.question.golden_answers == t.question.golden_answers
    assert reword("What's the capital of France?", "k").lower().count("what is the capital of france") == 1
    given = paraphrase_question(t, {t.question.id: "A different wording?"})
    assert given.question.question == "A different wording?"


def test_read_dump_formats(tmp_path, probes):
    ts = [p.trajectory for p in probes[:4]]
    write_jsonl(tmp_path / "bare.jsonl", (to_dict(t) for t in ts))
    write_jsonl(tmp_path / "eval.jsonl", ({"benchmark": "nq", "trajectory": to_dict(t)} for t in ts))
    (tmp_path / "groups.jsonl").write_text("\n".join(json.dumps(
        {"question_id": t.question.id, "trajectories": [{"trajectory": to_dict(t)}, to_dict(t)]}) for t in ts[:2]) + "\n")
    assert read_dump(tmp_path / "bare.jsonl") == ts == read_dump(tmp_path / "eval.jsonl")
    groups = read_dump(tmp_path / "groups.jsonl")
    assert len(groups) == 4 and as_rollouts(groups)[1] == 2  # exact duplicates dropped, and counted
    # a training run's rollout dump: gzip, group records with a `rollouts` list
    write_jsonl(tmp_path / "step-3.jsonl.gz", ({"question_id": t.question.id, "step": 3, "rollouts": [to_dict(t)]}
                                               for t in ts))
    assert read_dump(tmp_path / "step-3.jsonl.gz") == ts


def test_all_zero_filter(probes):
    t = probes[0].trajectory
    hit = dataclasses.replace(t, answer=t.question.golden_answers[0], sample_index=1)
    other = probes[1].trajectory
    assert other.question.id != t.question.id
    assert keep_all_zero([t, hit, other]) == [other]  # t's group has a verified hit: not an all-zero group


def test_all_zero_groups_first_then_others_to_balance_the_labels(probes):
    from collections import Counter

    from eviback.ape.data import all_zero_first_balanced

    ts = [p.trajectory for p in probes]
    # the first 40 questions get a verified hit: not all-zero groups; the others stay all-zero
    hits = [dataclasses.replace(t, answer=t.question.golden_answers[0], sample_index=9) for t in ts[:40]]
    chosen = all_zero_first_balanced(ts + hits, "salt")
    zero = keep_all_zero(ts + hits)
    assert all(t in chosen for t in zero)  # every all-zero rollout is kept
    extra = [t for t in chosen if t not in zero]
    counts = Counter(trajectory_label(t) for t in chosen)
    zero_counts = Counter(trajectory_label(t) for t in zero)
    rarer = min((Status.SUFFICIENT, Status.INSUFFICIENT), key=lambda s: zero_counts[s])
    assert extra and all(trajectory_label(t) is rarer for t in extra)  # only the rarer label is added
    assert abs(counts[Status.SUFFICIENT] - counts[Status.INSUFFICIENT]) <= abs(
        zero_counts[Status.SUFFICIENT] - zero_counts[Status.INSUFFICIENT])
    assert all_zero_first_balanced(ts + hits, "salt") == chosen  # deterministic
    assert set(map(id, all_zero_first_balanced(list(reversed(ts + hits)), "salt"))) >= set(map(id, extra))


def _cut(trajectory, chars):
    """The rollout as the observation cap leaves it: each observation cut to `chars` characters (a rollout
    cuts token ids; a character cut is the same shape: the last passage shortened, later ones unseen)."""
    turns = tuple(dataclasses.replace(t, observation=t.observation[:chars]) if t.executed else t
                  for t in trajectory.turns)
    return dataclasses.replace(trajectory, turns=turns)


def _seen_passages(trajectory):
    """The passages' texts the teacher is shown, numbering stripped."""
    import re
    text = re.sub(r"^Doc 1\(Title: ", "", blind_view(trajectory).evidence_text())
    return sorted(part.strip() for part in re.split(r"\nDoc \d+\(Title: ", text))


def test_reordered_evidence_is_the_evidence_as_the_actor_saw_it(probes):
    """The observation cut survives reordering: the teacher is shown the same seen texts in another order,
    never the full passages (a cut passage stays cut, a passage cut away stays unseen)."""
    checked = 0
    for p in probes[:20]:
        full = p.trajectory.turns[0].observation
        t = _cut(p.trajectory, len(full) // 2)
        r = reorder_evidence(t, "salt")
        if r is None:
            continue
        checked += 1
        assert _seen_passages(r) == _seen_passages(t)  # the same texts (white space at a cut aside)
        assert blind_view(r).evidence_text() != blind_view(t).evidence_text()
        seen_ids = {i for e in blind_view(t).seen for i in e.passage_ids}
        assert {i for e in blind_view(r).seen for i in e.passage_ids} == seen_ids
    assert checked >= 5


def test_reordered_evidence_of_uncut_rollouts_is_the_rendered_permutation(probes):
    from eviback.protocol import render_observation
    for p in probes[:10]:
        r = reorder_evidence(p.trajectory, "salt")
        for turn in r.turns:
            if turn.executed:
                assert turn.observation == render_observation(turn.passages)


def test_a_repeated_search_result_is_reordered_once_and_repeated(probes):
    t = probes[0].trajectory
    search = t.turns[0]
    t = dataclasses.replace(t, turns=(search, search) + t.turns[1:])
    r = reorder_evidence(t, "salt")
    assert r.turns[0] == r.turns[1] and r.turns[0].observation != search.observation
    assert len(blind_view(r).seen) == 1
