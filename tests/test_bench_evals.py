"""The scripts that compare two evaluations split F1 into searching and answering: whether a gold answer was in
the evidence each policy saw, F1 where both saw one, and which passage an answer turn cites."""

import importlib.util
import json
from pathlib import Path

import pytest

from eviback.metrics import score_answer
from eviback.protocol import render_observation
from eviback.types import Action, ActionKind, Passage, Question, StopReason, Trajectory, Turn, to_dict

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PASSAGES = (Passage("1", '"Eleanor Davis"\nEleanor Davis is an American cartoonist.'),
            Passage("2", '"Occupation of the Ruhr"\nThe occupation of the Ruhr began in 1923.'))


def record(qid: str, gold: str, answer: str, cite: int, passages=PASSAGES) -> dict:
    """One item of `eviback eval`'s items.jsonl: a search, then an answer turn citing Doc `cite`."""
    question = Question(qid, f"What is {qid}'s occupation?", (gold,), "popqa")
    turns = (Turn(f"<search> {qid} </search>", Action(ActionKind.SEARCH, qid), passages,
                  render_observation(passages), executed=True),
             Turn(f'<think> Doc {cite} ({passages[cite - 1].title if cite <= len(passages) else "x"}) says: '
                  f'"..." </think>\n<answer> {answer} </answer>', Action(ActionKind.ANSWER, answer)))
    trajectory = Trajectory(question, turns, answer, StopReason.ANSWERED)
    scores = score_answer(answer, (gold,))
    return {"benchmark": "popqa", "id": qid, "question": question.question, "answer": answer,
            "em": scores.em, "f1": scores.f1, "valid_answer": True, "searches": 1, "duplicate_searches": 0,
            "forced": False, "trajectory": to_dict(trajectory)}


def write(directory: Path, records: list[dict]) -> Path:
    directory.mkdir()
    (directory / "items.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return directory


def test_f1_splits_into_gold_in_evidence_and_answering_where_both_saw_it(tmp_path, capsys):
    compare = load("compare_evals")
    nothing = (Passage("3", '"Ruhr"\nA river.'),)
    before = write(tmp_path / "before", [record("a", "cartoonist", "cartoonist", 1),
                                         record("b", "cartoonist", "cartoonist", 1),
                                         record("c", "cartoonist", "river", 1, nothing)])
    after = write(tmp_path / "after", [record("a", "cartoonist", "1923", 2),
                                       record("b", "cartoonist", "cartoonist", 1),
                                       record("c", "cartoonist", "cartoonist", 1)])  # a guess: no gold seen
    out = tmp_path / "report.json"
    assert compare.main([str(before), str(after), "--samples", "200", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["before"]["gold_in_evidence"] == pytest.approx(2 / 3)
    assert report["after"]["gold_in_evidence"] == 1.0
    answering = report["answering"]
    assert answering["items"] == 2 and (answering["before"], answering["after"]) == (1.0, 0.5)
    assert answering["f1"]["diff"] == pytest.approx(-0.5)
    assert "| f1 where both saw a gold answer (2) | 1.000 | 0.500 |" in capsys.readouterr().out


def test_an_experiments_kept_evaluations_are_read_compressed(tmp_path):
    """An experiment keeps its evaluations as `eval/items.jsonl.gz`: compare_evals reads them as they are, and
    a directory with neither file is refused by name."""
    import gzip

    compare = load("compare_evals")
    before = write(tmp_path / "before", [record("a", "cartoonist", "river", 1), record("b", "cartoonist", "x", 1)])
    after = tmp_path / "after"
    after.mkdir()
    with gzip.open(after / "items.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in [record("a", "cartoonist", "cartoonist", 1),
                                                    record("b", "cartoonist", "x", 1)])
    out = tmp_path / "report.json"
    assert compare.main([str(before), str(after), "--samples", "200", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["items"] == 2 and (report["before"]["f1"], report["after"]["f1"]) == (0.0, 0.5)
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="empty holds no items.jsonl"):
        compare.main([str(before), str(tmp_path / "empty")])


def test_the_cited_passage_is_read_by_rank_against_where_the_gold_was(tmp_path):
    forms = load("first_query_forms")
    directory = write(tmp_path / "eval", [record("a", "cartoonist", "cartoonist", 1),
                                          record("b", "cartoonist", "1923", 2),
                                          record("c", "cartoonist", "1923", 2)])
    cited = forms.summarise(directory)["cited"]
    assert cited == {"items": 3, "rank": {"1": 1, "2": 2}, "holds_gold": pytest.approx(0.3333),
                     "first_gold_at_rank_1": 1.0}


def test_the_precondition_judges_with_the_experiments_own_teacher(tmp_path):
    """`bench_precondition --experiment`: the teacher (and the warm start, `--model LABEL=experiment`) of that
    experiment's runs on its data, so that a pre-registered gate measures what the runs will train with;
    without it, the demo's."""
    import argparse

    precondition = load("bench_precondition")
    data = str(tmp_path / "release")
    args = argparse.Namespace(experiment=Path(__file__).resolve().parents[1] / "experiments" / "cpu-round3.yaml",
                              data=data, teacher_arm="eviback")
    config = precondition.teacher_run_config(args)
    assert (config.data, config.warm_start_examples, config.learning_rate) == (data, 200, 1e-5)
    assert config.teacher.stage_a == "judge"  # round 3's Stage A: the calibrated evidence judge
    demo = precondition.teacher_run_config(argparse.Namespace(experiment=None, data=data, teacher_arm="eviback"))
    assert demo.data is None and demo.max_steps == 8
    with pytest.raises(SystemExit, match="needs --experiment"):
        precondition.experiment_warm_start(argparse.Namespace(experiment=None))


def test_group_size_shares_are_exact_over_subsets_and_a_teacher_failure_is_not_informative():
    by_size = load("precondition_by_group_size")
    # three all-zero rollouts: labels a, a, b; rewards 0.1, 0.1, None (the teacher failed on the third)
    group = {"em": [0, 0, 0], "labels": ["a", "a", "b"], "rewards": [0.1, 0.1, None]}
    at2 = by_size.shares([group], 2)
    assert at2["all_zero"] == 1.0
    assert at2["labels_differ"] == pytest.approx(2 / 3)  # {a,b} twice of the three pairs
    assert at2["informative"] == 0.0  # the pairs that differ hold the failure; the other pair's rewards agree
    group["rewards"] = [0.1, 0.0, 0.1]
    assert by_size.shares([group], 2)["informative"] == pytest.approx(2 / 3)
    hit = {"em": [1, 0, 0], "labels": ["a", "a", "b"], "rewards": [1.0, 0.0, 0.1]}
    assert by_size.shares([hit], 3) == {"all_zero": 0.0, "labels_differ": 0.0, "informative": 0.0}


def test_kept_rollouts_are_reused_only_for_the_model_that_made_them(tmp_path):
    """bench_precondition resumes from the rollouts under --work/LABEL: naming another model under the same
    label (the experiment's warm start after a builder change) is refused, not measured with the old rollouts."""
    precondition = load("bench_precondition")
    old, new = tmp_path / "old", tmp_path / "new"
    for directory, weights in ((old, b"old weights"), (new, b"new weights")):
        directory.mkdir()
        (directory / "config.json").write_text("{}")
        (directory / "model.safetensors").write_bytes(weights)
    folder = tmp_path / "work" / "round3"
    folder.mkdir(parents=True)
    precondition.check_model(folder, str(old))  # a fresh folder records its model
    (folder / "batch-0000.jsonl.gz").write_bytes(b"")
    precondition.check_model(folder, str(old))  # the same weights: reused
    with pytest.raises(SystemExit, match="holds the rollouts of another model"):
        precondition.check_model(folder, str(new))
    (folder / "model.json").unlink()
    with pytest.raises(SystemExit, match="no record of the model"):
        precondition.check_model(folder, str(old))
