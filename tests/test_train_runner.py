"""The training run's steps (train/runner.py): whatever way training ends, the teacher is closed."""

import types

import pytest

from eviback.teacher import load_policy
from eviback.train import runner
from eviback.train.config import TrainConfig
from eviback.train.run import RunDir


class _Teacher:
    """Stands in for eviback.teacher.Teacher: records that it was closed."""

    def __init__(self) -> None:
        self.policy = load_policy("two-stage-extractive")
        self.closed = 0

    def judge_groups(self, groups):
        raise AssertionError("not called: training fails before any step")

    def close(self) -> None:
        self.closed += 1


class _FailingTrainer:
    def train(self, **kwargs):
        raise RuntimeError("killed mid-step")


@pytest.mark.parametrize("where", ["train", "make_trainer"])
def test_the_teacher_is_closed_when_training_raises(tmp_path, monkeypatch, where):
    teacher = _Teacher()

    def make_trainer(*args):
        if where == "make_trainer":
            raise RuntimeError("killed mid-step")
        return _FailingTrainer()

    # Nothing heavy: no model, no engine, no evaluation; the run directory and the teacher are real calls.
    monkeypatch.setattr(runner, "build_training", lambda config, start, server=None: types.SimpleNamespace())
    monkeypatch.setattr(runner, "evaluate_start", lambda config, start, training: None)
    monkeypatch.setattr(runner, "open_teacher", lambda config: teacher)
    monkeypatch.setattr(runner, "make_trainer", make_trainer)
    try:
        with pytest.raises(RuntimeError, match="killed mid-step"):
            runner.run_training(TrainConfig(), tmp_path / "run")
        assert teacher.closed == 1
        assert "policy_used" in (tmp_path / "run" / "teacher.json").read_text()
    finally:
        RunDir(tmp_path / "run").unlock()
