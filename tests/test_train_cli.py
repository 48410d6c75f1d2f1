"""`eviback train` end to end, as a user runs it: the real model, the real retriever over the embedded
corpus, the local teacher; then a run killed with SIGKILL and resumed."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from eviback.backoff import BackoffConfig, group_advantages
from eviback.types import Verdict, from_dict
from log_checks import assert_clean_run

pytestmark = pytest.mark.slow

# Small enough for a 2-core CI machine: 2 questions x 2 rollouts per step, short turns, HF generation.
TINY = {
    "backend": "hf",
    "warm_start": False,
    "group_size": 2,
    "questions_per_step": 2,
    "max_turns": 1,
    "max_turn_tokens": 24,
    "max_obs_tokens": 64,
    "save_steps": 1,
    "teacher_backend": "local",
    "teacher_stage_a": "prompted",  # the trained evidence judge's build is tested in test_evidence_judge.py
    "train_files": ["popqa_train"],
}


def run_train(tmp_path, name: str, steps: int, *extra: str, wait: bool = True, tracker=None):
    """`eviback train` on the tiny config; with `tracker` (a path), `report_to=[recorder]` records there what the
    Trainer hands its integrations (tests/tracker_recorder.py)."""
    config = tmp_path / f"{name}.yaml"
    config.write_text(yaml.safe_dump({**TINY, "max_steps": steps}))
    program = ["-m", "eviback.cli"]
    if tracker is not None:
        program = [str(Path(__file__).with_name("tracker_recorder.py")), str(tracker)]
        extra = (*extra, "--set", "report_to=[recorder]")
    command = [sys.executable, *program, "train", "--config", str(config),
               "--output", str(tmp_path / name), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("TRL_EXPERIMENTAL_SILENCE", None)  # what a user's shell has: TRL's notices are eviback's to silence
    if not wait:
        return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=1500)


def records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_train_writes_a_complete_run_directory(tmp_path):
    # validated after every step on 2 held-out questions; a tracker integration (report_to) records its logs
    tracker = tmp_path / "tracker.jsonl"
    result = run_train(tmp_path, "run", 2, "--set", "val_every=1", "--set", "val_benchmarks=[nq]",
                       "--set", "val_limit=2", tracker=tracker)
    assert result.returncode == 0, result.stderr[-3000:]
    # the command ends with what the run did, the sentences that open its report
    assert "## What happened (the top of the report)" in result.stdout and "- This run trained" in result.stdout
    assert_clean_run(result)  # its log: eviback's lines and progress bars only, none on stdout
    run = tmp_path / "run"
    assert yaml.safe_load((run / "config.yaml").read_text())["max_steps"] == 2
    metrics = records(run / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    for key in ("rollout/em", "rollout/valid_answer_rate", "rollout/avg_searches", "backoff/all_zero_share",
                "backoff/fallback_share", "teacher/calls", "teacher/errors", "time/rollout", "time/teacher",
                "time/update", "train/loss", "memory/peak_rss_gb", "train/engine_logp_diff_mean",
                "train/engine_logp_diff_max", "train/is_ratio_mean", "rollout/length_cut_share", "time/cpu",
                "host/other_cpu_s", "host/steal_share", "train/update_tokens", "train/scored_tokens"):
        assert key in metrics[0], key
    # the update's tokens: every kept rollout's prompt and response (no group is dropped in GRPO+teacher)
    assert metrics[0]["train/update_tokens"] > metrics[0]["train/scored_tokens"] > 0
    assert metrics[0]["time/cpu"] > 0  # the run's own CPU seconds over the step (train/gauges.py)
    # the engine (a bf16 HF copy) and the trainer (bf16 with fp32 masters) sample the same policy: small
    # differences, measured; TRL's EOS-based "clipped" figure is replaced by the share cut by the budget
    assert 0 <= metrics[0]["train/engine_logp_diff_mean"] < 0.5
    assert 0 <= metrics[0]["rollout/length_cut_share"] <= 1
    assert json.loads((run / "teacher.json").read_text())["boundary_compliant"] is True
    groups = records(run / "groups.jsonl")
    assert len(groups) == 2 * 2 and {g["step"] for g in groups} == {1, 2}
    # groups.jsonl stays small: no passage or model text; whole rollouts go to the last steps' dumps only
    assert "contents" not in (run / "groups.jsonl").read_text()
    dumps = sorted((run / "rollouts").iterdir())
    assert [d.name for d in dumps] == ["step-000001.jsonl.gz", "step-000002.jsonl.gz"]
    with gzip.open(dumps[-1], "rt") as f:
        full = [json.loads(line) for line in f]
    assert [g["question_id"] for g in full] == [g["question_id"] for g in groups if g["step"] == 2]
    assert all(len(g["rollouts"]) == 2 and "turns" in g["rollouts"][0] for g in full)
    backoff = BackoffConfig()
    for g in groups:
        assert len(g["summaries"]) == 2 and len(g["em"]) == 2
        # the logged advantages are exactly what the pure backoff computes from the logged EM and verdicts
        verdicts = [from_dict(Verdict, v) for v in g["verdicts"]] if g["verdicts"] else None
        assert g["advantages"] == pytest.approx(list(group_advantages(g["em"], verdicts, backoff).advantages))
        # the teacher judged exactly the groups without a verified hit
        assert (g["verdicts"] is not None) == (max(g["em"]) < 1)
    step1 = [g for g in groups if g["step"] == 1]
    judged = sum(len(g["verdicts"]) for g in step1 if g["verdicts"])
    assert metrics[0]["teacher/judged"] == judged
    assert metrics[0]["backoff/all_zero_share"] == sum(max(g["em"]) < 1 for g in step1) / len(step1)
    assert (run / "final" / "model.safetensors").exists() and (run / "report.html").exists()
    assert "<table>" in (run / "report.html").read_text()
    assert (run / "plots" / "training_curves.png").exists()
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("checkpoint-"))
    # each step's line holds its validation (the weights of that step, greedy, on 2 NQ questions); the items too
    for m in metrics:
        assert m["val/questions"] == 2 and 0 <= m["val/em"] <= 1 and "val/nq/f1" in m and m["time/validation"] > 0
        assert m["time/update"] <= m["time/step"] - m["time/validation"]
        items = run / "val" / f"step-{m['step']:06d}" / "items.jsonl"
        assert len(items.read_text().splitlines()) == 2
    assert "Validated 2 times during training on 2 held-out questions" in (run / "report.html").read_text()
    # the tracker got every figure of every metrics.jsonl line at its step: under its name there, or the same
    # number under TRL's own name (train/loss is TRL's `loss`)
    from eviback.train.step_log import TRL_KEYS

    trl_name = {name: key for key, name in TRL_KEYS.items()} | {"train/learning_rate": "learning_rate"}
    logged = {r["step"]: r["logs"] for r in records(tracker) if "loss" in r["logs"]}
    assert sorted(logged) == [1, 2]
    for m in metrics:
        logs = logged[m["step"]]
        for key in ("backoff/fallback_share", "teacher/calls", "time/update", "memory/peak_rss_gb", "val/em",
                    "val/nq/em", "time/validation"):
            assert key in logs, key
        for key, value in m.items():
            if key != "step" and isinstance(value, int | float):
                assert logs.get(key, logs.get(trl_name.get(key))) == value, key
    # the same directory is not silently reused
    again = run_train(tmp_path, "run", 2)
    assert again.returncode == 2 and "--resume" in again.stderr


def test_a_killed_run_resumes_from_its_last_checkpoint(tmp_path):
    # one rollout per forward/backward pass (4 micro-batches per step), as a memory-bound run sets it; the
    # learning rate warms up over 2 of the 3 steps (0.67 x 3, rounded down), across the kill
    settings = ("--set", "micro_batch_rows=1", "--set", "lr_scheduler_type=constant_with_warmup",
                "--set", "warmup_ratio=0.67")
    # validated after every step, on one held-out question: the kill may fall in a validation
    settings += ("--set", "val_every=1", "--set", "val_benchmarks=[nq]", "--set", "val_limit=1")
    process = run_train(tmp_path, "killed", 3, *settings, wait=False)
    state = tmp_path / "killed" / "checkpoints" / "checkpoint-1" / "trainer_state.json"
    deadline = time.time() + 1200
    while not state.exists() and process.poll() is None and time.time() < deadline:
        time.sleep(0.5)
    assert state.exists(), process.stderr.read()[-3000:] if process.poll() is not None else "no checkpoint"
    process.send_signal(signal.SIGKILL)
    process.wait()
    before = records(tmp_path / "killed" / "metrics.jsonl")
    assert before and before[0]["step"] == 1

    result = run_train(tmp_path, "killed", 3, *settings, "--resume")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resuming" in result.stderr
    metrics = records(tmp_path / "killed" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3]  # each step logged once; step 1 kept from the first run
    assert metrics[0] == before[0]
    # each step's update used the warm-up's rate (the resumed steps the checkpoint's scheduler): 0, 1/2, 1 x 1e-6
    assert [m["train/learning_rate"] for m in metrics] == pytest.approx([0.0, 5e-7, 1e-6])
    groups = records(tmp_path / "killed" / "groups.jsonl")
    assert sorted({g["step"] for g in groups}) == [1, 2, 3] and len(groups) == 3 * 2
    # one validation a step, in its line; a step redone after the kill redid its validation afresh
    assert all(m["val/questions"] == 1 for m in metrics)
    for step in (1, 2, 3):
        items = tmp_path / "killed" / "val" / f"step-{step:06d}" / "items.jsonl"
        assert len(items.read_text().splitlines()) == 1


def test_a_leaky_teacher_is_refused_before_anything_runs(tmp_path):
    """A status stage that sees the gold answers breaks the evidence boundary: `eviback` mode refuses it
    (nothing is written), and the explicit option runs it as the baseline, recording the verdict."""
    from eviback.train.config import resolve_config
    from eviback.train.runner import check_teacher

    result = run_train(tmp_path, "leaky", 1, "--set", "teacher=single-prompt-dual-task")
    assert result.returncode != 0
    assert "breaks the evidence boundary" in result.stderr and "allow_leaky_teacher=true" in result.stderr
    assert not (tmp_path / "leaky").exists()
    record = check_teacher(resolve_config("eviback-single-prompt"))
    assert record["boundary_compliant"] is False and record["allowed_leaky"] is True
    assert len(record["version"]) == 64 and record["boundary_violations"]
    assert check_teacher(resolve_config("eviback"))["boundary_compliant"] is True
    assert check_teacher(resolve_config("grpo")) is None
