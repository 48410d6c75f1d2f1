"""Which teacher policy a training run uses: a local two-stage teacher has the trained evidence judge as
Stage A and the extractive Stage B by default; the prompted stages on request; any other policy or an HTTP
teacher unchanged."""

import json

import pytest
import yaml

from eviback.teacher import evidence_judge, load_policy
from eviback.teacher.evidence_judge import judge_policy
from eviback.train import runner
from eviback.train.config import TrainConfig
from eviback.train.run import RunDir
from eviback.train.runner import teacher_policy

SHA = "ab" * 32


@pytest.fixture
def built(monkeypatch, tmp_path):
    asked = []
    # a competent judge's record (training refuses a weak one: test_evidence_judge_competence.py)
    judge_dir = tmp_path / "judges" / "j"
    judge_dir.mkdir(parents=True)
    (judge_dir / "judge.json").write_text(json.dumps({"key": "j", "sha256": SHA, "heldout": {
        "n": 283, "gate_balanced_accuracy": 0.74}}))
    evidence_judge.register(judge_dir, SHA)

    def build_judge(config):  # stands in for the build, tested end to end in test_evidence_judge.py
        asked.append(config)
        return evidence_judge.EvidenceJudge(judge_dir, SHA, judge_dir / "policy.json")
    monkeypatch.setattr(runner, "build_judge", build_judge)  # where training calls it
    return asked


def test_a_local_two_stage_teacher_has_the_judge_and_the_extractive_stage_b_by_default(built):
    config = TrainConfig.from_settings(train_files=["popqa_train"], judge_max_questions=50, max_obs_tokens=300,
                                       judge_rollouts=["ws_rollouts.jsonl.gz"])
    policy = teacher_policy(config)
    assert policy == judge_policy(SHA, base=load_policy("two-stage-extractive"))
    assert policy.name == "two-stage-extractive-judge"
    assert [s.backend for s in policy.stages] == [f"evidence-judge:{SHA}", "extractive-span:max_words=8"]
    assert not policy.needs_llm and policy.boundary_violations() == ()  # the local teacher loads no LLM
    (asked,) = built
    assert asked.train_files == ("popqa_train",) and asked.max_questions == 50 and asked.max_observation_tokens == 300
    assert asked.rollouts == ("ws_rollouts.jsonl.gz",)  # the warm start's rollouts the judge learns from


def test_the_prompted_stages_other_policies_and_http_teachers(built):
    # the LLM Stage B: exactly the policy the judge's build freezes beside it
    assert teacher_policy(TrainConfig.from_settings(teacher_stage_b="prompted")) == judge_policy(SHA)
    assert teacher_policy(TrainConfig.from_settings(teacher_stage_a="prompted")) == load_policy("two-stage-extractive")
    assert len(built) == 1  # the judge is built only for Stage A
    built.clear()
    both = TrainConfig.from_settings(teacher_stage_a="prompted", teacher_stage_b="prompted")
    assert teacher_policy(both) == load_policy("two-stage")
    assert teacher_policy(TrainConfig.from_settings(teacher="single-prompt-dual-task")) == \
        load_policy("single-prompt-dual-task")
    # a served teacher keeps its LLM stages
    served = TrainConfig.from_settings(teacher_backend="http", teacher_url="http://x/v1")
    assert teacher_policy(served) == load_policy("two-stage")
    assert built == []
    with pytest.raises(ValueError, match="teacher_stage_a"):
        TrainConfig.from_settings(teacher_stage_a="other")
    with pytest.raises(ValueError, match="teacher_stage_b must be 'extractive' or 'prompted'"):
        TrainConfig.from_settings(teacher_stage_b="llm")


def test_the_span_bound_is_a_setting_and_part_of_the_version(built):
    policy = teacher_policy(TrainConfig.from_settings(teacher_stage_a="prompted", teacher_span_words=12))
    assert policy.stages[1].backend == "extractive-span:max_words=12"
    assert policy.version != load_policy("two-stage-extractive").version
    with pytest.raises(ValueError, match="no extractive stage"):
        teacher_policy(TrainConfig.from_settings(teacher="single-prompt-dual-task", teacher_span_words=12))
    with pytest.raises(ValueError, match="teacher_span_words must be >= 0"):
        TrainConfig.from_settings(teacher_span_words=-1)


def test_a_run_made_before_the_extractive_default_does_not_resume_with_it(tmp_path):
    run = RunDir(tmp_path / "run")
    run.start(TrainConfig.from_settings(teacher_stage_b="prompted"), resume=False)
    old = yaml.safe_load(run.config_path.read_text())
    del old["teacher_stage_b"]  # what an earlier eviback wrote: its Stage B was the LLM's
    run.config_path.write_text(yaml.safe_dump(old))
    # named with what it ran (the LLM's Stage B), and how to continue it so
    with pytest.raises(ValueError, match="teacher_stage_b: 'prompted' -> 'extractive'.*--set teacher_stage_b=prompted"):
        run.start(TrainConfig(), resume=True)
    assert run.start(TrainConfig.from_settings(teacher_stage_b="prompted"), resume=True) is None


def test_the_f1_fallback_baseline_loads_no_teacher():
    from eviback.train.config import resolve_config
    from eviback.train.runner import check_teacher, open_teacher

    config = resolve_config("f1-fallback")
    assert open_teacher(config) is None and check_teacher(config) is None
