"""A judge checks itself: its build scores its held-out gate, a judge below the floor is weak, and training
refuses a weak judge as Stage A (before anything is written) unless the run accepts it, which teacher.json
records. The weak judge here is really built, by the path training takes: a cross-encoder (training's
judge_architecture=cross-encoder) with a learning rate of 0, which cannot learn."""

import dataclasses
import json
import logging

import pytest

from eviback.teacher.evidence_judge import GATE_FLOOR, competence, register
from eviback.train import judge_builder, runner
from eviback.train.config import TrainConfig
from eviback.train.judge_builder import WeakJudgeError, check_stage_a
from eviback.train.run import RunDir

pytestmark = pytest.mark.slow  # builds a (tiny) judge: the bundled encoder, a few seconds

SHA = "cd" * 32


@pytest.fixture
def cannot_learn(monkeypatch, tmp_path_factory):
    """Training's judge builds, made tiny and unable to learn (learning rate 0): its held-out gate is chance."""
    out = tmp_path_factory.getbasetemp() / "judge-that-cannot-learn"
    real = judge_builder.build_judge

    def build(config, **kwargs):
        tiny = dataclasses.replace(config, learning_rate=0.0, max_length=96, batch_size=8, heldout_share=0.25,
                                   threads=1, output=str(out))
        return real(tiny, progress=lambda message: None)

    monkeypatch.setattr(runner, "build_judge", build)  # where training calls it
    return out


def weak_config(**settings) -> TrainConfig:
    return TrainConfig.from_settings(judge_max_questions=16, judge_epochs=0.2, judge_architecture="cross-encoder",
                                     **settings)


def test_training_refuses_a_judge_that_cannot_learn(cannot_learn, tmp_path):
    from eviback.train import runner

    with pytest.raises(WeakJudgeError) as refused:
        runner.run_training(weak_config(), tmp_path / "run")
    message = str(refused.value)
    # one paragraph: the judge, its figures against the floor, why it matters, and the fix
    assert "\n" not in message
    assert "held-out gate (I vs not-I balanced accuracy) 0.500" in message and f"the floor is {GATE_FLOOR}" in message
    assert "final training loss" in message
    for fix in ("judge_architecture=bi-encoder", "judge_max_questions=0", "judge_epochs=3", "judge_rollouts",
                "teacher_stage_a=prompted", "accept_weak_judge=true"):
        assert fix in message
    assert not (tmp_path / "run").exists()  # refused before the run directory, the warm start, anything
    doc = json.loads((cannot_learn / "judge.json").read_text())
    assert doc["competence"]["weak"] is True and doc["competence"]["gate"] == 0.5  # the build says so too
    assert doc["heldout"]["n"] > 0 and doc["train"]["last_loss"] > 1.0


def test_a_run_that_accepts_the_weak_judge_records_it(cannot_learn, tmp_path, caplog):
    from eviback.train.runner import record_teacher, teacher_policy

    with caplog.at_level(logging.WARNING):
        policy = teacher_policy(weak_config(accept_weak_judge=True))
    assert policy.name == "two-stage-extractive-judge"
    assert "accept_weak_judge=true" in caplog.text and "0.500" in caplog.text

    class Teacher:
        pass

    teacher = Teacher()
    teacher.policy = policy
    run = RunDir(tmp_path / "run")
    run.root.mkdir(parents=True)
    record_teacher(run, {"policy": "two-stage"}, teacher)
    judge = json.loads(run.teacher_path.read_text())["evidence_judge"]
    assert judge["weak"] is True and judge["weak_accepted"] is True and judge["gate"] == 0.5
    assert judge["path"] == str(cannot_learn) and judge["floor"] == GATE_FLOOR


def _judge_dir(path, heldout, sha=SHA):
    path.mkdir(parents=True, exist_ok=True)
    (path / "judge.json").write_text(json.dumps({"format": "eviback-evidence-judge", "key": "k" * 20, "sha256": sha,
                                                 "heldout": heldout, "train": {"last_loss": 0.8}}))
    register(path, sha)
    return path


def test_the_floor_and_a_judge_that_was_never_measured(tmp_path):
    from eviback.teacher import load_policy
    from eviback.teacher.evidence_judge import judge_policy

    good = competence(_judge_dir(tmp_path / "good", {"n": 283, "gate_balanced_accuracy": 0.74, "kappa": 0.4,
                                                     "by_source": {"search": {"gate_balanced_accuracy": 0.74}}}))
    assert not good.weak and good.by_source == {"search": 0.74}
    assert competence(tmp_path / "good", floor=0.8).weak
    assert competence(_judge_dir(tmp_path / "low", {"n": 50, "gate_balanced_accuracy": 0.59})).weak
    unmeasured = competence(_judge_dir(tmp_path / "none", {}))  # no held-out question: not known to gate
    assert unmeasured.weak and unmeasured.gate is None and "not measured" in unmeasured.figures()
    # a policy whose Stage A is no trained judge has nothing to check; a competent judge passes
    assert check_stage_a(load_policy("two-stage-extractive"), accept_weak=False) is None
    _judge_dir(tmp_path / "good", {"n": 283, "gate_balanced_accuracy": 0.74})
    assert check_stage_a(judge_policy(SHA), accept_weak=False).gate == 0.74


def test_a_cached_judge_is_named_by_key_or_hash(tmp_path, monkeypatch):
    from eviback.teacher import evidence_judge
    from eviback.teacher.evidence_judge import resolve_judge

    monkeypatch.setenv("EVIBACK_CACHE", str(tmp_path))
    monkeypatch.setattr(evidence_judge, "_DIRECTORIES", {})
    monkeypatch.setattr(evidence_judge, "read_artifact", lambda path: None)  # no frozen policy beside these
    for key, sha in (("abcdef11" + "0" * 12, "ee" * 32), ("abcdef22" + "0" * 12, "ff" * 32)):
        directory = tmp_path / "judges" / f"evidence-judge-{key}"
        directory.mkdir(parents=True)
        (directory / "judge.json").write_text(json.dumps({"format": "eviback-evidence-judge", "key": key,
                                                          "sha256": sha}))
    assert resolve_judge("abcdef11").sha256 == "ee" * 32  # by a leading part of its cache key
    assert resolve_judge("ffffff").sha256 == "ff" * 32  # by a leading part of its hash
    assert resolve_judge("evidence-judge-abcdef22").sha256 == "ff" * 32  # by its directory's name
    assert resolve_judge(str(tmp_path / "judges" / f"evidence-judge-abcdef11{'0' * 12}")).sha256 == "ee" * 32
    with pytest.raises(ValueError, match="names 2 cached judges"):
        resolve_judge("abcdef")
    with pytest.raises(ValueError, match="at least 6 hex digits"):
        resolve_judge("abc")
    with pytest.raises(FileNotFoundError, match="no evidence judge"):
        resolve_judge("123456")


def test_a_judge_measured_elsewhere_is_measured_again_where_the_run_computes(tmp_path, monkeypatch):
    """A judge's verdict holds where it was measured: a judge whose build measured it on a GPU in bf16 is
    measured again from its held-out examples where the run computes (here the CPU), recorded in judge.json,
    and judged by those figures; a second run reads them."""
    from types import SimpleNamespace

    from eviback.data import write_jsonl
    from eviback.device import place
    from eviback.teacher.evidence_judge import judge_policy
    from eviback.train.judge_builder import HELDOUT_FILE, JudgeExample, placement_name
    from eviback.types import Status

    monkeypatch.setenv("EVIBACK_CACHE", str(tmp_path / "cache"))
    path = _judge_dir(tmp_path / "gpu-built", {"n": 2, "gate_balanced_accuracy": 0.82, "measured_on": "cuda/bfloat16"})
    examples = [JudgeExample("q1", "Who wrote Hamlet?", "Doc 1(Title: \"Hamlet\") ...", Status.SUFFICIENT, "search"),
                JudgeExample("q2", "Who wrote Emma?", "Doc 1(Title: \"Mars\") ...", Status.INSUFFICIENT, "rollout")]
    write_jsonl(path / HELDOUT_FILE, [dataclasses.asdict(e) for e in examples])
    measured = []

    def figures(client, heldout):
        measured.append([e.question_id for e in heldout])
        return {"n": len(heldout), "gate_balanced_accuracy": 0.55}

    monkeypatch.setattr(judge_builder, "EvidenceJudgeClient", lambda directory, sha, device: SimpleNamespace())
    monkeypatch.setattr(judge_builder, "heldout_figures", figures)
    with pytest.raises(WeakJudgeError, match="0.550"):
        check_stage_a(judge_policy(SHA), accept_weak=False, device="cpu")
    here = placement_name(place("cpu"))
    doc = json.loads((path / "judge.json").read_text())
    assert doc["heldout_on"][here]["gate_balanced_accuracy"] == 0.55 and measured == [["q1", "q2"]]
    assert check_stage_a(judge_policy(SHA), accept_weak=True, device="cpu").gate == 0.55 and len(measured) == 1
    doc["heldout"]["measured_on"] = here  # measured where the run computes: the build's own figures
    (path / "judge.json").write_text(json.dumps(doc))
    assert check_stage_a(judge_policy(SHA), accept_weak=False, device="cpu").gate == 0.82 and len(measured) == 1
