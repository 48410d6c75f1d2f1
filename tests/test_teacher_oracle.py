"""The oracle teacher, the ceiling: Stage A is the evidence label (it reads the gold), Stage B the extractive
span. It is flagged as breaking the evidence boundary, named "oracle" wherever the teacher is named, refused
by a run that has not opted in and by `eviback demo`, and loads no model."""

import dataclasses

import pytest

from eviback.cli import main
from eviback.protocol import render_observation
from eviback.teacher import TeacherConfig, build_teacher, load_policy
from eviback.teacher.boundary import CanaryAudit, plant_canaries
from eviback.teacher.labels import trajectory_label
from eviback.teacher.policy import EVIDENCE_LABEL, PolicyError, TeacherPolicy
from eviback.teacher.probes import build_probes
from eviback.teacher.rules import NoModelClient
from eviback.train.config import preset_names, resolve_config
from eviback.train.runner import check_teacher, teacher_is_oracle
from eviback.types import Action, ActionKind, Passage, Question, Status, StopReason, Trajectory, Turn

S, I, A = Status.SUFFICIENT, Status.INSUFFICIENT, Status.AMBIGUOUS  # noqa: E741 - the method's labels
ORACLE = load_policy("oracle")
EXIES_10 = Passage("10", '"Weezer"\nHash Pipe is a song by Weezer; its bassist Matt Sharp left the band.')
EXIES_11 = Passage("11", '"Matt Sharp"\nMatt Sharp later formed The Rentals and produced The Exies.')
OTHER = Passage("99", '"Oak"\nThe oak is a tree of the genus Quercus.')
HOTPOT = Question("h", "Which band did the bassist of Hash Pipe's band later produce?", ("The Exies",),
                  dataset="hotpotqa", metadata={"gold_passage_ids": ["10", "11"]})


def rollout(passages, question=HOTPOT, answer="Weezer"):
    turn = Turn("<search> Hash Pipe </search>", Action(ActionKind.SEARCH, "Hash Pipe"), tuple(passages),
                render_observation(passages), True)
    return Trajectory(question, (turn, Turn(f"<answer> {answer} </answer>", Action(ActionKind.ANSWER, answer))),
                      answer, StopReason.ANSWERED)


@pytest.fixture(scope="module")
def oracle():
    with build_teacher(TeacherConfig(policy="oracle", backend="local", cache="")) as teacher:
        yield teacher


def test_the_oracle_is_flagged_named_and_needs_no_model(oracle):
    assert ORACLE.is_oracle and "oracle" in ORACLE.name and ORACLE.stages[0].backend == EVIDENCE_LABEL
    assert ORACLE.stages[1].backend == "extractive-span:max_words=8"
    (reason,) = ORACLE.boundary_violations()
    assert "evidence label" in reason and "oracle" in reason
    assert not ORACLE.needs_llm and isinstance(oracle.client, NoModelClient)  # the local backend loaded nothing
    assert not load_policy("two-stage").is_oracle and not load_policy("single-prompt-dual-task").is_oracle
    with pytest.raises(PolicyError, match="name must say so"):
        dataclasses.replace(ORACLE, name="ceiling")
    with pytest.raises(PolicyError, match="make it the first stage"):
        TeacherPolicy(name="x-oracle", stages=(load_policy("two-stage").stages[0],
                                               dataclasses.replace(ORACLE.stages[0], name="L", run_on=(S, A))))


@pytest.mark.parametrize("passages, status, answer, reward, stage_b", [
    ((EXIES_10, EXIES_11), S, "Exies", 1.0, True),  # the answer and the full support (a span starts on a gold word)
    ((EXIES_11,), A, "Exies", 0.5, True),  # the answer without the full support: v[A] x F1
    ((EXIES_10,), I, "", 0.0, True),  # part of the support, no answer: A, then no span: I
    ((OTHER,), I, "Weezer", 0.0, False),  # nothing: I, Stage B never runs
])
def test_the_oracle_labels_then_extracts(oracle, passages, status, answer, reward, stage_b):
    t = rollout(passages)
    verdict = oracle.judge_one(t)
    assert verdict.stage_a_status is trajectory_label(t)
    assert verdict.status is status and verdict.answer == answer and verdict.reward == pytest.approx(reward)
    assert verdict.stage_b_ran is stage_b and verdict.error is None and not verdict.ungrounded


def test_the_oracle_stage_a_is_the_evidence_label_on_real_probes(oracle):
    rollouts = [p.trajectory for p in build_probes(16, seed=2)]
    verdicts = oracle.judge(rollouts)
    assert [v.stage_a_status for v in verdicts] == [trajectory_label(t) for t in rollouts]
    assert {v.stage_a_status for v in verdicts} >= {S, I}
    assert all(v.reward == 0.0 for v in verdicts if v.stage_a_status is I)


def test_the_canary_audit_catches_the_oracle_reading_the_gold():
    planted, canaries = plant_canaries([rollout((EXIES_10, EXIES_11))], seed=1)
    audit = CanaryAudit(ORACLE, canaries)
    with build_teacher(TeacherConfig(policy="oracle", cache="")) as teacher:
        teacher.on_request = audit
        teacher.judge(planted)
    assert audit.leaks and {leak.stage for leak in audit.leaks} == {"A"}


def test_a_run_needs_the_explicit_opt_in_and_records_the_oracle():
    assert "eviback-oracle" in preset_names()
    config = resolve_config("eviback-oracle")
    assert config.teacher.policy == "oracle" and config.teacher.allow_leaky and teacher_is_oracle(config)
    record = check_teacher(config)
    assert record["oracle"] is True and record["name"] == "oracle" and record["allowed_leaky"] is True
    with pytest.raises(ValueError, match="breaks the evidence boundary.*eviback-oracle preset"):
        check_teacher(resolve_config("eviback", overrides=["teacher=oracle"]))
    assert check_teacher(resolve_config("eviback"))["oracle"] is False
    assert not teacher_is_oracle(resolve_config("grpo", overrides=["teacher=oracle"]))  # no teacher at all


def test_the_demo_refuses_the_oracle(tmp_path, capsys):
    out = tmp_path / "demo"
    code = main(["demo", "--output", str(out), "--set", "teacher=oracle", "--set", "allow_leaky_teacher=true"])
    assert code == 2 and "refuses the oracle" in capsys.readouterr().err
    assert not out.exists()
