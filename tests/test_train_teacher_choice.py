"""Which teacher policy a training run uses: the trained evidence judge as Stage A of a local two-stage
teacher by default; the prompted Stage A on request; any other policy or an HTTP teacher unchanged."""

from pathlib import Path

import pytest

from eviback.teacher import evidence_judge
from eviback.train.config import TrainConfig
from eviback.train.runner import teacher_policy_ref


@pytest.fixture
def built(monkeypatch):
    asked = []

    def build_judge(config):  # stands in for the build, tested end to end in test_evidence_judge.py
        asked.append(config)
        return evidence_judge.EvidenceJudge(Path("/judges/j"), "ab" * 32, Path("/judges/j/policy.json"))
    monkeypatch.setattr(evidence_judge, "build_judge", build_judge)
    return asked


def test_a_local_two_stage_teacher_uses_the_trained_judge_by_default(built):
    config = TrainConfig(train_files=["popqa_train"], judge_max_questions=50, max_obs_tokens=300)
    assert teacher_policy_ref(config) == "/judges/j/policy.json"
    (asked,) = built
    assert asked.train_files == ("popqa_train",) and asked.max_questions == 50 and asked.max_obs_tokens == 300


def test_the_prompted_stage_a_other_policies_and_http_teachers_are_unchanged(built):
    assert teacher_policy_ref(TrainConfig(teacher_stage_a="prompted")) == "two-stage"
    assert teacher_policy_ref(TrainConfig(teacher="single-prompt-dual-task")) == "single-prompt-dual-task"
    assert teacher_policy_ref(TrainConfig(teacher_backend="http", teacher_url="http://x/v1")) == "two-stage"
    assert built == []
    with pytest.raises(ValueError, match="teacher_stage_a"):
        teacher_policy_ref(TrainConfig(teacher_stage_a="other"))


def test_a_judge_at_chance_is_reported(tmp_path, caplog):
    import json
    import logging

    from eviback.train.runner import warn_if_uninformative

    at_chance = {"heldout": {"n": 95, "kappa": 0.0, "balanced_accuracy": 1 / 3}}
    (tmp_path / "judge.json").write_text(json.dumps(at_chance))
    with caplog.at_level(logging.WARNING):
        assert warn_if_uninformative(tmp_path)
    assert "at chance" in caplog.text
    (tmp_path / "judge.json").write_text(json.dumps({"heldout": {"n": 283, "kappa": 0.455}}))
    assert not warn_if_uninformative(tmp_path)
