"""A wrong value for a documented training setting is refused by `eviback train` before any work: exit code 2,
one line naming the setting and what it takes, no traceback, nothing written.

One bad value per kind of setting: a number out of range at the top of the config (learning rate, KL beta,
gradient clipping, counts), a choice TRL would meet only in its first loss pass (`loss_type`), a value of the
wrong type, and a bad value in each section (rollout, backoff, teacher, importance sampling), the device and
the dtype.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from eviback.cli import main

BAD = [
    ("loss_type=ppo", ["loss_type", "dapo", "dr_grpo"]),  # the allowed values are listed
    ("learning_rate=-1e-6", ["learning_rate", "> 0"]),
    ("learning_rate=nan", ["learning_rate", "> 0"]),
    ("beta=-0.1", ["beta", ">= 0"]),
    ("max_grad_norm=-1", ["max_grad_norm", ">= 0"]),
    ("eval_limit=0", ["eval_limit", ">= 1"]),
    ("save_total_limit=0", ["save_total_limit", ">= 1"]),
    ("max_steps=many", ["max_steps", "integer"]),  # the wrong type
    ("warm_start=maybe", ["warm_start", "true or false"]),
    ("eval_benchmarks={nq: 1}", ["eval_benchmarks", "list of strings"]),
    ("group_size=1", ["group_size", ">= 2"]),  # rollout section
    ("temperature=-1", ["temperature"]),
    ("mode=ppo", ["ppo", "Mode"]),  # backoff section
    ("lam=-0.1", ["lam", ">= 0"]),
    ("teacher_backend=ftp", ["teacher_backend", "'local' or 'http'"]),  # teacher section
    ("teacher_concurrency=0", ["teacher_concurrency", ">= 1"]),
    ("judge_epochs=0", ["judge_epochs", "> 0"]),
    ("is_level=block", ["is_level", "token or sequence"]),  # importance-sampling section
    ("is_cap=0", ["is_cap", "> 0"]),
    ("dtype=float16", ["dtype", "bfloat16"]),
    ("device=tpu", ["device", "cuda"]),
    ("nonsense=1", ["unknown setting 'nonsense'"]),
]


@pytest.mark.parametrize(("override", "words"), BAD, ids=[b[0] for b in BAD])
def test_a_bad_value_is_refused_before_any_work(override, words, tmp_path, capsys):
    output = tmp_path / "run"
    code = main(["train", "--preset", "demo", "--set", override, "--output", str(output)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("eviback train: error:") and "Traceback" not in err
    for word in words:
        assert word in err, (word, err)
    assert not output.exists()  # nothing was written: refused before the run directory


def test_the_command_refuses_in_its_own_process_without_a_traceback(tmp_path):
    """The installed command itself: the same refusal from a fresh process, before any model is loaded."""
    done = subprocess.run([sys.executable, "-m", "eviback.cli", "train", "--set", "beta=-1", "--output",
                           str(tmp_path / "run")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "beta must be a number >= 0" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "run").exists()
