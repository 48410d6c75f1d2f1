"""`benchmarks/gpu_check.py --tiny`: the GPU check's whole path (models written, generation variants, the
update, `eviback eval`, three `eviback train` presets and the large-model step) on the CPU with tiny sizes, so
that the check a GPU user runs cannot rot between GPU runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


def test_tiny_check_runs_every_part_and_reports_it(tmp_path):
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--tiny", "--out", str(out),
                           "--work", str(tmp_path / "work")], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((out / "gpu.json").read_text())
    assert report["tiny"] and not report["failed"]
    parts = report["parts"]
    assert set(parts) == {"peaks", "generate", "update", "eval", "train", "train-4b"}
    assert parts["peaks"]["matmul_bf16_tflops"] > 0 and parts["peaks"]["copy_gbs"] > 0
    variants = parts["generate"]["tiny"]["variants"]
    assert len(variants) == 3 and all(v["tokens_per_s"] > 0 for v in variants.values())
    assert parts["update"]["tiny"]["tokens_per_s"] > 0
    assert parts["eval"]["questions"] == 4 and parts["eval"]["placements"]["not_on_device"] == []
    for name in ("grpo", "eviback", "eviback-oracle"):
        run = parts["train"][name]
        assert run["steps"] == 1 and run["placements"]["not_on_device"] == [], name
        assert any("trainer: cpu" == m for m in run["placements"]["models"]), run["placements"]
    assert any(m.startswith("evidence judge") for m in parts["train"]["eviback"]["placements"]["models"])
    assert parts["train"]["eviback"]["fallback_groups"] == [2.0]  # random weights: every group all-zero
    assert parts["train-4b"]["steps"] == 1
    markdown = (out / "gpu.md").read_text()
    for heading in ("Ceilings measured in this run", "Generation", "Update", "Runs as a user runs them"):
        assert heading in markdown
