"""Teacher policies: built-ins, content-hash versions, frozen artifacts refused after an edit, validation."""

import dataclasses
import json

import pytest

from eviback.teacher.policy import (
    Decoding,
    Input,
    OutputField,
    PolicyError,
    RewardWeights,
    StageSpec,
    TeacherPolicy,
    builtin_policy_names,
    freeze_policy,
    load_policy,
    parse_artifact,
    policy_from_json,
    read_artifact,
)
from eviback.types import Status

S, I, A = Status.SUFFICIENT, Status.INSUFFICIENT, Status.AMBIGUOUS  # noqa: E741 - the method's labels


def test_builtins_load_and_only_the_baseline_leaks():
    assert set(builtin_policy_names()) >= {"two-stage", "single-prompt-dual-task"}
    two = load_policy("two-stage")
    single = load_policy("single-prompt-dual-task")
    assert [s.name for s in two.stages] == ["A", "B"]
    assert not two.stages[0].sees_gold and two.stages[1].sees_gold
    assert two.stages[1].run_on == (S, A)
    assert two.boundary_violations() == ()
    assert single.boundary_violations() and len(single.stages) == 1
    assert (two.weights.sufficient, two.weights.ambiguous, two.weights.insufficient) == (1.0, 0.5, 0.0)


def test_version_is_the_hash_of_the_content():
    two = load_policy("two-stage")
    assert len(two.version) == 64 and two.version == load_policy("two-stage").version
    edited = dataclasses.replace(two, weights=RewardWeights(ambiguous=0.4))
    assert edited.version != two.version
    # the version survives a round trip through JSON
    assert policy_from_json(two.canonical_json()).version == two.version


def test_pinned_version(tmp_path):
    two = load_policy("two-stage")
    assert load_policy(f"two-stage@{two.version[:10]}") == two
    with pytest.raises(PolicyError, match="does not match the pinned"):
        load_policy("two-stage@deadbeefdeadbeef")
    with pytest.raises(PolicyError, match="too short"):
        load_policy("two-stage@c30")


def test_frozen_artifact_is_refused_after_an_edit(tmp_path):
    path = freeze_policy(load_policy("two-stage"), tmp_path / "p.json", {"gate_report": {"leaks": 0}})
    assert read_artifact(path).provenance == {"gate_report": {"leaks": 0}}
    doc = json.loads(path.read_text())
    doc["policy"]["stages"][0]["user_template"] += " Also consider the reference answer: $question"
    path.write_text(json.dumps(doc))
    with pytest.raises(PolicyError, match="was edited"):
        load_policy(path)
    # editing the provenance (e.g. a gate report) is refused too
    path2 = freeze_policy(load_policy("two-stage"), tmp_path / "q.json", {"gate_report": {"leaks": 0}})
    doc = json.loads(path2.read_text())
    doc["provenance"]["gate_report"]["leaks"] = 3
    path2.write_text(json.dumps(doc))
    with pytest.raises(PolicyError, match="provenance was edited"):
        read_artifact(path2)


def test_freeze_writes_once(tmp_path):
    two, single = load_policy("two-stage"), load_policy("single-prompt-dual-task")
    path = freeze_policy(two, tmp_path / "p.json")
    assert freeze_policy(two, path) == path  # identical: a no-op
    with pytest.raises(FileExistsError, match="written once"):
        freeze_policy(single, path)
    assert parse_artifact(path.read_text()).version == two.version


def _stage(name="A", **kw):
    base = dict(name=name, sees=(Input.QUESTION, Input.EVIDENCE), system_prompt="", outputs=(OutputField.STATUS,),
                user_template="$question $evidence")
    base.update(kw)
    return StageSpec(**base)


@pytest.mark.parametrize("stages, message", [
    ((), "no stages"),
    ((_stage(outputs=(OutputField.ANSWER,)),), "must output 'status'"),
    ((_stage(user_template="$question $gold"),), "does not see them"),
    ((_stage(user_template="$question $secret"),), "unknown template placeholders"),
    ((_stage(), _stage("B", run_on=(S, I))), "remove I from run_on"),
    ((_stage(), _stage("B")), "needs a gate"),
    ((_stage(), _stage("A", run_on=(S,))), "unique"),
    ((_stage(run_on=(S,)),), "first stage always runs"),
])
def test_malformed_policies_are_refused_with_the_fix(stages, message):
    with pytest.raises(PolicyError, match=message):
        TeacherPolicy(name="x", stages=stages)


def test_weights_and_decoding_validation():
    with pytest.raises(PolicyError, match="I rollout gets no reward"):
        RewardWeights(insufficient=0.1)
    with pytest.raises(PolicyError, match="temperature"):
        Decoding(temperature=-1)
    with pytest.raises(PolicyError, match="lone"):
        TeacherPolicy(name="x", stages=(_stage(user_template="costs $5 $question"),))
    # `$$` is a literal dollar sign
    TeacherPolicy(name="x", stages=(_stage(user_template="costs $$5 $question"),))


def test_a_candidate_that_lets_gold_reach_stage_a_is_flagged_statically():
    leaky = TeacherPolicy(name="leaky", stages=(
        _stage(sees=(Input.QUESTION, Input.GOLD), user_template="$question"),))
    assert leaky.boundary_violations()  # seeing gold is enough, even if the template does not use it
