"""A real E2E-APE run on the bundled SmolLM2 (teacher and controller in process) over a small dump of rollouts on
training questions, through the command line, and a frozen winner judging rollouts on the real model in
`eviback judge`. The budget is tiny (a handful of rollouts, two candidates, loose thresholds): this checks the
path a user runs, not the teacher's quality.

Whether the real model's winner passes the sealed test is the model's to decide, so the two paths are two
tests that each always assert theirs: the real run asserts what holds either way (a frozen policy exactly
when the sealed test confirms, the exit code, the report, the replay), and the freeze and load path runs
with the scripted teacher of test_ape_pipeline, whose winner the sealed test always confirms."""

import json

import pytest

from eviback.ape import run_ape
from eviback.ape.spec import spec_from_mapping
from eviback.cli import main
from eviback.data import write_jsonl
from eviback.teacher.policy import read_artifact
from eviback.teacher.probes import build_probes
from eviback.types import to_dict
from log_checks import assert_clean_in_process, capture_command_log

pytestmark = pytest.mark.slow

SPEC = """
schema_version: 1
stability:
  rollouts: 2
  samples: 2
  bootstrap_resamples: 100
  constant_teacher: pass
  repeated_sampling: {min_agreement: 0.0, min_kappa: null}
  reordered_evidence: {min_agreement: 0.0, min_kappa: null}
  paraphrased_question: {min_agreement: 0.0, min_kappa: null}
objective: {min_labelled: 2}
data: {train: 0.4, validation: 0.3, test: 0.3, feedback_rollouts: 2}
search:
  seeds: [single-prompt-dual-task]     # two-stage comes first from --seed-policy
  mutations: []
  rounds: 1
  proposals_per_round: 1
  mutations_per_round: 0
  controller_max_tokens: 24
"""


@pytest.fixture
def torch_threads():
    """`--threads 1` is process-wide: restore the thread count for the other tests."""
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_a_real_run_decides_on_the_sealed_test_and_replays(tmp_path, torch_threads, caplog, capfd, recwarn,
                                                            monkeypatch):
    (tmp_path / "spec.yaml").write_text(SPEC)
    out = tmp_path / "run"
    rollouts = tmp_path / "rollouts.jsonl.gz"
    write_jsonl(rollouts, (to_dict(p.trajectory) for p in build_probes(10, source="train")))
    args = ["ape", str(rollouts), "--out", str(out), "--spec", str(tmp_path / "spec.yaml"),
            "--backend", "local", "--controller", "local", "--threads", "1", "--concurrency", "1",
            "--seed-policy", "two-stage"]
    capture_command_log(caplog, monkeypatch)
    code = main(args)
    assert_clean_in_process(capfd, caplog, recwarn)  # its log: eviback's lines only
    result = json.loads((out / "result.json").read_text())
    confirmation = result["confirmation"]
    confirmed = confirmation["confirmed"]
    assert code == (0 if confirmed else 1)
    winner = result["selection"]["winner"]
    assert winner and result["test"]["winner"] == winner
    assert {c["candidate"]["id"] for c in result["candidates"]} >= {"s0", "s1"}
    assert "- two-stage\n  - single-prompt-dual-task" in (out / "spec.yaml").read_text()
    assert next(c for c in result["candidates"] if c["candidate"]["id"] == "s1")["phase"] == "static"
    assert any(p["id"] == "r1.p0" for p in result["rejected_proposals"]) or any(
        c["candidate"]["id"] == "r1.p0" for c in result["candidates"])  # the controller was asked
    baseline = result["test"]["baseline_metrics"]["boundary"]
    assert baseline["gold_leaks"] == baseline["audited_requests"] > 0  # canaries caught the manual policy
    assert result["test"]["winner_metrics"]["boundary"]["gold_leaks"] == 0
    report = (out / "report.md").read_text()
    assert "## Sealed test" in report and "Freeze rule `lower-bound-above-baseline`" in report
    # a frozen policy exactly when the sealed test confirmed the winner; otherwise the reasons
    assert (out / "teacher.json").exists() == confirmed == bool(result["frozen_version"])
    assert ("Nothing frozen: the sealed test did not confirm" in report) == (not confirmed)
    assert confirmed or confirmation["reasons"]
    if confirmed:
        assert read_artifact(out / "teacher.json").version == result["frozen_version"]

    # the same command again: everything is replayed from the log, nothing is judged
    events = (out / "events.jsonl").read_text().count("\n")
    assert main(args) == code
    again = json.loads((out / "result.json").read_text())
    assert again["teacher_calls"] == result["teacher_calls"] and again["selection"] == result["selection"]
    assert (out / "events.jsonl").read_text().count("\n") == events


def test_a_frozen_winner_judges_rollouts_on_the_real_model(tmp_path, torch_threads, caplog, capfd, recwarn,
                                                           monkeypatch):
    """The freeze and load path, reached every time: E2E-APE freezes the winner that the sealed test confirms
    (the scripted teacher of test_ape_pipeline makes it so), and `eviback judge` loads it by path and version,
    as a user gives it, and judges rollouts with the real model."""
    from test_ape_pipeline import SPEC as SCRIPTED_SPEC
    from test_ape_pipeline import Oracle, config, controller, planted_rollouts

    dump, planted, _ = planted_rollouts(tmp_path)
    oracle = Oracle(planted)
    result = run_ape(config(tmp_path / "run", dump), spec_from_mapping(SCRIPTED_SPEC), client=oracle.client,
                     controller=controller(), progress=oracle.progress)
    assert result.confirmation is not None and result.confirmation.confirmed
    artifact = read_artifact(result.frozen_path)
    assert artifact.version == result.frozen_version and artifact.provenance["gate_report"]

    rollouts = tmp_path / "rollouts.jsonl"
    write_jsonl(rollouts, (to_dict(p.trajectory) for p in build_probes(2, seed=21)))
    policy = f"{result.frozen_path}@{artifact.version[:12]}"
    verdicts = tmp_path / "verdicts.jsonl"
    # the scripted run's output is not the command's
    capfd.readouterr()
    recwarn.clear()
    caplog.clear()
    capture_command_log(caplog, monkeypatch)
    assert main(["judge", str(rollouts), "--backend", "local", "--policy", policy, "--threads", "1", "--no-cache",
                 "--concurrency", "1", "--out", str(verdicts)]) == 0
    assert_clean_in_process(capfd, caplog, recwarn)  # its log: eviback's lines only
    rows = [json.loads(line) for line in verdicts.read_text().splitlines()]
    assert len(rows) == 2 and all(r["verdict"]["status"] in ("S", "A", "I") for r in rows)
    assert all(r["verdict"]["policy_version"] == artifact.version for r in rows)
