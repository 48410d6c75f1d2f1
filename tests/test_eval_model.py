"""End to end: `eviback eval` with the real SmolLM2 and the real BM25 retriever over the embedded suite,
on the session's vLLM engine (in-process CLI) and on the HF backend (as a user runs it, in a subprocess)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from eviback import cli
from eviback.evaluate import read_items, read_summary
from eviback.metrics import rollout_metrics
from log_checks import assert_clean_in_process, assert_clean_run, capture_command_log

pytestmark = pytest.mark.slow


def test_eval_cli_on_vllm(vllm_backend, vllm_kv_cache_gib, tmp_path, caplog, capfd, recwarn, monkeypatch):
    # vllm_backend starts the engine, before this test's body: its start-up lines are the demo's test's to check
    from eviback.generation import vllm as engines

    capture_command_log(caplog, monkeypatch)
    out = tmp_path / "eval"
    argv = ["eval", "--benchmarks", "nq,hotpotqa", "--limit", "2", "--max-turns", "1", "--max-turn-tokens", "48",
            "--kv-cache-gib", str(vllm_kv_cache_gib), "--out", str(out), "--no-progress"]
    engines_before = dict(engines._ENGINES)
    assert cli.main(argv) == 0
    engines_after = dict(engines._ENGINES)
    assert engines_after == engines_before  # the CLI reused the running engine, started none
    items = read_items(out / "items.jsonl")
    assert [i.benchmark for i in items] == ["nq", "nq", "hotpotqa", "hotpotqa"]
    assert len(items) == 4 and {i.benchmark for i in items} == {"nq", "hotpotqa"}
    summary = read_summary(out / "summary.json")
    assert summary.overall.n == 4
    for row in summary.benchmarks:
        assert row.metrics == rollout_metrics(i.trajectory for i in items if i.benchmark == row.name)
    assert "| nq | 2 |" in (out / "summary.md").read_text()
    assert (out / "viewer.html").stat().st_size > 1000
    # rerunning resumes: nothing left to do, same summary
    assert cli.main(argv) == 0
    assert read_summary(out / "summary.json") == summary and len(read_items(out / "items.jsonl")) == 4
    assert_clean_in_process(capfd, caplog, recwarn)  # its log: eviback's lines only


def test_eval_cli_on_hf_as_a_user_runs_it(tmp_path):
    out = tmp_path / "eval"
    result = subprocess.run(
        [sys.executable, "-m", "eviback.cli", "eval", "--backend", "hf", "--benchmarks", "popqa", "--limit", "2",
         "--max-turns", "1", "--max-turn-tokens", "32", "--out", str(out), "--no-progress"],
        capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "| popqa | 2 |" in result.stdout and "viewer:" in result.stdout
    assert_clean_run(result)  # its log: eviback's lines only, none on stdout
    records = [json.loads(line) for line in (out / "items.jsonl").read_text().splitlines()]
    assert len(records) == 2
    for r in records:
        assert r["trajectory"]["turns"] and r["stop_reason"] in ("answered", "forced", "length")
        assert r["trajectory"]["tokens"] is None
