"""`eviback train` in two processes on CPU (gloo), launched as `accelerate launch` launches it (torchrun),
killed mid-run and resumed: each process rolls out its own whole groups, the run directory gets one
metrics line per step with every process's groups, one final model and one evaluation."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from test_train_cli import TINY as CLI_TINY

pytestmark = pytest.mark.slow

# the single-process CLI test's tiny run, one question per process and step, with a held-out evaluation
TINY = {**CLI_TINY, "questions_per_step": 1, "eval_benchmarks": ["nq"], "eval_limit": 2}


def torchrun(tmp_path, steps: int, *extra: str) -> subprocess.Popen:
    config = tmp_path / f"tiny-{steps}.yaml"
    config.write_text(yaml.safe_dump({**TINY, "max_steps": steps}))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", "eviback.cli", "train", "--config", str(config), "--output", str(tmp_path / "run"), *extra]
    env = {**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1", "OMP_NUM_THREADS": "1"}
    # its own process group, so that the launcher and both workers can be killed at once
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)


def kill_tree(pid: int) -> None:
    """SIGKILL the launcher and every process under it (its workers may not share its process group)."""
    import psutil

    parent = psutil.Process(pid)
    for process in [*parent.children(recursive=True), parent]:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.send_signal(signal.SIGKILL)
    psutil.wait_procs(parent.children(recursive=True), timeout=30)


def records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_two_processes_train_are_killed_and_resume(tmp_path):
    run = tmp_path / "run"
    first = torchrun(tmp_path, 50)
    state = run / "checkpoints" / "checkpoint-1" / "trainer_state.json"
    deadline = time.time() + 1500
    while not state.exists() and first.poll() is None and time.time() < deadline:
        time.sleep(0.5)
    if not state.exists():
        first.kill()
        pytest.fail("no checkpoint: " + (first.stderr.read()[-4000:] if first.poll() is not None else "timeout"))
    kill_tree(first.pid)
    first.wait()

    second = torchrun(tmp_path, 2, "--resume")
    _, stderr = second.communicate(timeout=1500)
    assert second.returncode == 0, stderr[-4000:]
    assert "resuming" in stderr and "already holds a run" not in stderr

    metrics = records(run / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]  # one line per step, whatever the number of processes
    assert all(m["processes"] == 2 for m in metrics)
    assert all(m["backoff/groups"] == 2 and m["rollout/trajectories"] == 4 for m in metrics)
    groups = records(run / "groups.jsonl")
    assert sorted(g["step"] for g in groups) == [1, 1, 2, 2]  # each process's whole group, logged once
    assert all(len(g["em"]) == 2 for g in groups)
    assert (run / "final" / "model.safetensors").exists()
    summary = json.loads((run / "eval" / "summary.json").read_text())
    assert summary["overall"]["n"] == 2
    assert len((run / "eval" / "items.jsonl").read_text().splitlines()) == 2  # evaluated once, not per process
    assert (run / "report.html").exists()
