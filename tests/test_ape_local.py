"""A real E2E-APE run on the bundled SmolLM2 (teacher and controller in process) over a small dump of rollouts on
training questions, through the command line; the sealed test decides whether the winner is frozen, and a
frozen winner then judges rollouts in `eviback judge`. The budget is tiny (a handful of
rollouts, two candidates, loose thresholds): this checks the path a user runs, not the teacher's quality."""

import json

import pytest

from eviback.cli import main
from eviback.data import write_jsonl
from eviback.teacher.policy import read_artifact
from eviback.teacher.probes import build_probes
from eviback.types import to_dict

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


def test_a_real_run_freezes_a_policy_that_eviback_judge_loads(tmp_path, capsys):
    import torch

    threads = torch.get_num_threads()  # --threads 1 is process-wide: restore it for the other tests
    try:
        (tmp_path / "spec.yaml").write_text(SPEC)
        out = tmp_path / "run"
        rollouts = tmp_path / "rollouts.jsonl.gz"
        write_jsonl(rollouts, (to_dict(p.trajectory) for p in build_probes(10, source="train")))
        args = ["ape", str(rollouts), "--out", str(out), "--spec", str(tmp_path / "spec.yaml"),
                "--backend", "local", "--controller", "local", "--threads", "1", "--concurrency", "1",
                "--seed-policy", "two-stage"]
        code = main(args)
        result = json.loads((out / "result.json").read_text())
        confirmation = result["confirmation"]
        assert code == (0 if confirmation["confirmed"] else 1)
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
        if not confirmation["confirmed"]:  # the sealed test did not confirm the winner: nothing is frozen
            assert confirmation["reasons"] and not (out / "teacher.json").exists()
            assert "Nothing frozen: the sealed test did not confirm" in report
            assert main(args) == 1 and json.loads((out / "result.json").read_text()) == result  # replayed
            return
        artifact = read_artifact(out / "teacher.json")
        assert artifact.version == result["frozen_version"] and artifact.provenance["gate_report"]

        # the same command again: everything is replayed from the log, nothing is judged
        events = (out / "events.jsonl").read_text().count("\n")
        assert main(args) == 0
        assert json.loads((out / "result.json").read_text())["teacher_calls"] == result["teacher_calls"]
        assert (out / "events.jsonl").read_text().count("\n") == events
        capsys.readouterr()

        dump = tmp_path / "dump.jsonl"
        write_jsonl(dump, (to_dict(p.trajectory) for p in build_probes(2, seed=21)))
        policy = f"{out / 'teacher.json'}@{artifact.version[:12]}"
        verdicts = tmp_path / "verdicts.jsonl"
        assert main(["judge", str(dump), "--backend", "local", "--policy", policy, "--threads", "1", "--no-cache",
                     "--concurrency", "1", "--out", str(verdicts)]) == 0
        rows = [json.loads(line) for line in verdicts.read_text().splitlines()]
        assert len(rows) == 2 and all(r["verdict"]["status"] in ("S", "A", "I") for r in rows)
        assert all(r["verdict"]["policy_version"] == artifact.version for r in rows)
    finally:
        torch.set_num_threads(threads)
