"""`benchmarks/gpu_check.py`: the GPU check's whole path on the CPU, so that the check a GPU user runs cannot
rot between GPU runs.

The slow test runs `--prepare-offline` and then `--tiny` from the saved tokenizers, as on a GPU machine
without the bundled packages: models written, the update, three `eviback train` presets (the evidence judge on
a random-weight encoder), the large-model step, the generation variants and `eviback eval`, as subprocesses.
The fast ones check the arithmetic and the report of failed and skipped parts, which a passing run never shows.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


def load_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_tiny_check_runs_every_part_and_reports_it(tmp_path):
    offline = tmp_path / "offline"
    done = subprocess.run([sys.executable, str(SCRIPT), "--prepare-offline", str(offline)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (offline / "smollm2" / "tokenizer.json").exists() and (offline / "minilm" / "config.json").exists()
    assert not list(offline.rglob("*.safetensors"))  # tokenizers and a config only

    out = tmp_path / "out"
    done = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--out", str(out), "--work", str(tmp_path / "work"),
                           "--tokenizer", str(offline / "smollm2"), "--judge-tokenizer", str(offline / "minilm")],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "| part | status | wall s | figures |" in done.stdout  # the short table, printed last

    report = json.loads((out / "gpu.json").read_text())
    assert report["tiny"] and report["failed"] == []
    parts = report["parts"]
    assert list(parts) == ["peaks", "update", "train", "train-4b", "generate", "generate-server", "eval"]
    assert set(report["part_wall_s"]) == set(parts)
    for name, part in parts.items():
        assert not {"error", "skipped"} & set(part), (name, part)
    assert report["models"]["policy_vocab"] == 49152 and report["models"]["decode_past_vocab"] == {"49152": "", "151935": ""}

    assert parts["peaks"]["matmul_bf16_tflops"] > 0 and parts["peaks"]["copy_gbs"] > 0
    for row in parts["update"].values():
        assert row["tokens_per_s"] > 0 and row["vocab"] == 151936 and row["mfu"] is None  # GPU-only: None here
    assert [r["checkpointing"] for r in parts["update"].values()] == [False, True]
    generate = parts["generate"]["tiny"]
    assert generate["hbm_bound_tokens_per_s"] is None
    assert [v["options"] for v in generate["variants"].values()] == [{}, {"grouped_attention": False, "cache": "dynamic"}]
    for variant in generate["variants"].values():
        assert variant["tokens_per_s"] > 0 and variant["generated"] == 4 * 8 and variant["bound_share"] is None
        profile = variant["profile"]  # where a step's time goes; on the CPU no GPU share, ops ranked by CPU time
        assert profile["steps"] == 4 and profile["ms_per_step"] > 0 and profile["device_busy_share"] is None
        assert profile["ranked_by"] == "self CPU time" and profile["top"] and profile["top"][0]["ms_per_step"] > 0

    server = parts["generate-server"]  # a real `vllm serve` of the tiny policy, started by `eviback serve-policy`
    assert server["generated"] == 4 * 8 and server["tokens_per_s"] > 0 and server["bound_share"] is None
    assert server["push"].startswith("not run: the NCCL weight push needs CUDA")
    assert "VLLM_SERVER_DEV_MODE=1 vllm serve " in (out / "serve-policy.log").read_text()

    assert parts["eval"]["generated_tokens"] > 0 and parts["eval"]["generation_tokens_per_s"] > 0  # throughput.json
    assert parts["eval"]["questions"] == 4 and parts["eval"]["placements"]["not_on_device"] == []
    for name in ("grpo", "eviback", "eviback-oracle"):
        run = parts["train"][name]
        assert run["steps"] == 1 and run["gpu_peak_gb"] == [] and run["cpu_s_per_step"], name
        assert run["placements"]["not_on_device"] == [] and "trainer: cpu" in run["placements"]["models"], name
        assert (out / f"train-{name}" / "metrics.jsonl").exists()
    assert any(m.startswith("evidence judge") for m in parts["train"]["eviback"]["placements"]["models"])
    assert parts["train"]["eviback"]["fallback_groups"] == [2.0]  # random weights: every group all-zero
    assert parts["train-4b"]["steps"] == 1

    markdown = (out / "gpu.md").read_text()
    for text in ("Ceilings measured in this run", "## Update", "## Generation", "Where a decoding step's time went",
                 "through a policy server",
                 "Runs as a user runs them",
                 "train eviback", "train 4B shape", "49,152"):
        assert text in markdown, text
    assert "Failed" not in markdown and "Not run" not in markdown


def test_parameter_count_is_the_models():
    import torch
    from transformers import Qwen3ForCausalLM

    check = load_check()

    class Tokenizer:
        bos_token_id, eos_token_id, pad_token_id = 1, 2, 2

    for shape, vocab, expected in (("0.6B", 151936, 596_049_920), ("4B", 151936, 4_022_468_096),
                                   ("0.6B", 49152, 490_799_104)):
        config = check.qwen3_config(shape, vocab, Tokenizer())
        with torch.device("meta"):
            model = Qwen3ForCausalLM(config)
        assert check.parameters(config) == sum(p.numel() for p in model.parameters()) == expected
    assert check.kv_bytes_per_token(check.qwen3_config("0.6B", 49152, Tokenizer())) == 112 * 1024


def test_decode_bound_is_weights_plus_kv_cache_over_bandwidth():
    check = load_check()

    class Config:
        num_hidden_layers, num_key_value_heads, head_dim = 1, 1, 1  # 4 bytes of KV cache per token

    # 2 rollouts x 2 steps after a 3-token prompt: weights read twice (20 B), KV of 3 then 4 tokens per rollout
    bytes_read = 2 * 10 + 2 * 4 * (3 + 4)
    assert check.decode_bound_tokens_per_s(Config(), 2, 3, 2, 1e-9, 10) == pytest.approx(4 / bytes_read)


def test_report_names_failed_and_skipped_parts():
    check = load_check()
    report = {"command": "python benchmarks/gpu_check.py", "date": "2026-12-04 00:00 UTC", "wall_s": 12.0,
              "tiny": False, "failed": ["generate", "train eviback"],
              "machine": {"python": "3.12", "torch": "2", "transformers": "5", "cpus": 16, "gpu": "GPU X",
                          "gpu_memory_gb": 80.0, "cuda": "13.0"},
              "models": {"choice": "policies: the tokenizer's 49,152 ids"},
              "part_wall_s": {"generate": 3.0, "train": 5.0},
              "parts": {"generate": {"error": "RuntimeError: every generation variant failed"},
                        "train": {"eviback": {"error": "train-eviback exited 2:\nboom | here"},
                                  "grpo": {"skipped": "over the time budget (--budget-s)"}},
                        "eval": {"skipped": "over the time budget (--budget-s)"}}}
    markdown = check.markdown(report)
    assert "- generate" in markdown and "- train eviback" in markdown  # under "Failed"
    assert "| train eviback | failed: train-eviback exited 2: boom / here |" in markdown
    assert "| train grpo | not run: over the time budget" in markdown
    assert "## Not run" in markdown and "- eval: over the time budget" in markdown
    table = check.summary_table(report)
    assert "| generate | FAILED |" in table and "| eval | not run |" in table
    assert "| train | failed in part |" in table
