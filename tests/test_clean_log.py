"""A user can tell which lines of a log matter: the demo, run as a user runs it from a fresh cache, writes
only eviback's own lines and progress bars (no third-party warning, no trainer's dict of raw figures), its
stdout no log line (vLLM's own lines included), and `-v` still shows every third-party line. The demo is
shrunk to one step on a handful of questions; every phase of `make demo` still runs (GGUF conversion, warm
start, vLLM, held-out evaluations, the evidence judge's build, a TRL step, the report). The other commands'
tests check their own logs likewise (tests/log_checks.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from eviback.log_format import foreign_lines, log_lines
from log_checks import assert_clean_run

pytestmark = pytest.mark.slow

TINY_DEMO = ["--steps", "1", "--set", "warm_start_examples=4", "--set", "eval_limit=3",
             "--set", "judge_max_questions=16", "--set", "judge_epochs=1", "--set", "accept_weak_judge=true",
             "--set", "max_turn_tokens=64", "--set", "max_obs_tokens=96"]


def eviback(tmp_path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "EVIBACK_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    for name in ("TRL_EXPERIMENTAL_SILENCE", "HF_HUB_DISABLE_PROGRESS_BARS", "TRANSFORMERS_VERBOSITY",
                 "VLLM_LOGGING_LEVEL", "VLLM_LOGGING_STREAM"):
        env.pop(name, None)  # what a user's shell has: nothing that quiets a library already
    return subprocess.run([sys.executable, "-m", "eviback.cli", *args], capture_output=True, text=True, env=env,
                          timeout=3000, cwd=tmp_path)


def test_the_demo_writes_only_eviback_lines_and_its_report_says_what_happened(tmp_path):
    run = tmp_path / "demo"
    result = eviback(tmp_path, "demo", "--output", str(run), *TINY_DEMO)
    assert result.returncode == 0, result.stderr[-4000:]
    assert foreign_lines(result.stderr) == [], "\n".join(foreign_lines(result.stderr))
    # stdout is the demo's own: its table and summary, no trainer's `{'loss': ...}` line, no log line (vLLM's
    # own handler writes to stdout unless told otherwise)
    assert log_lines(result.stdout) == [], "\n".join(log_lines(result.stdout))
    assert not [line for line in result.stdout.splitlines() if line.startswith("{'")]
    assert "## What happened" in result.stdout and "paired bootstrap" in result.stdout
    page = (run / "report.html").read_text()
    assert "What happened" in page and "held-out F1, start -&gt; trained (9 questions)" in page


def test_verbose_shows_the_third_party_lines(tmp_path):
    # the cross-encoder build loads the encoder with a new classification head: transformers reports it MISSING
    args = ["build-judge", "--architecture", "cross-encoder", "--max-questions", "16", "--epochs", "1",
            "--batch-size", "8", "--max-length", "96", "--heldout-share", "0.25", "--threads", "1"]
    shown = eviback(tmp_path, "-v", *args, "--output", str(tmp_path / "judge-v"))
    assert shown.returncode == 0, shown.stderr[-4000:]
    assert "LOAD REPORT" in shown.stderr and "classifier.weight" in shown.stderr  # the new head, as transformers says
    assert "DEBUG bm25s: Building index" in shown.stderr  # bm25s's own debug line
    quiet = eviback(tmp_path, *args, "--output", str(tmp_path / "judge"), "--force")
    assert quiet.returncode == 0, quiet.stderr[-4000:]
    assert "LOAD REPORT" not in quiet.stderr and "bm25s" not in quiet.stderr
    assert_clean_run(quiet)  # `eviback build-judge`'s own log: its progress as eviback's lines
