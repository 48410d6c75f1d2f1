"""`benchmarks/gpu_check.py`: the GPU check's whole path on the CPU, so that the check a GPU user runs cannot
rot between GPU runs.

The slow test runs `--prepare-offline` and then `--tiny` from the saved tokenizers, as on a GPU machine
without the bundled packages: models written, the update, three `eviback train` presets (the evidence judge on
a random-weight encoder), the large-model step, the generation variants and `eviback eval`, as subprocesses.
The fast ones check the arithmetic (parameters, the decoding bound, the 4B step's memory, the parts' time
estimates), the time budget on a fake clock, and the report of failed, cut and skipped parts, which a passing
run never shows.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


def load_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve their annotations through it
    spec.loader.exec_module(module)
    return module


class FakeClock:
    """A clock the test moves: no sleeping."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


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
                           "--tokenizer", str(offline / "smollm2"), "--judge-tokenizer", str(offline / "minilm"),
                           "--presets", "eviback,grpo,eviback-oracle"],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "| part | status | estimate s | wall s | figures |" in done.stdout  # the short table, printed last
    assert "train-4b memory arithmetic, with a reference model" in done.stdout  # printed before the part

    report = json.loads((out / "gpu.json").read_text())
    assert report["tiny"] and report["failed"] == [] and report["cut"] == {} and report["budget_s"] is None
    parts = report["parts"]
    assert list(parts) == ["peaks", "update", "train", "train-4b", "generate", "generate-server", "eval"]
    assert set(report["part_wall_s"]) == set(parts) == set(report["estimates_s"])
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
    big = parts["train-4b"]
    assert big["steps"] == 1 and big["settings"]["beta"] == 0.001  # no GPU memory to check: the first choice
    assert big["settings"]["micro_batch_rows"] == 2 and big["settings"]["gradient_checkpointing"] == "true"
    assert set(big["memory"]["phases_gb"]) == {"rollout", "update", "optimizer step"}
    assert big["memory"]["measured_peak_gb"] is None  # no GPU

    markdown = (out / "gpu.md").read_text()
    for text in ("Ceilings measured in this run", "## Update", "## Generation", "Where a decoding step's time went",
                 "through a policy server", "Runs as a user runs them", "The 4B step's GPU memory, by arithmetic",
                 "train eviback", "train 4B shape", "49,152", "Time budget: none"):
        assert text in markdown, text
    assert "Failed" not in markdown and "Not run" not in markdown and "Cut at the time budget" not in markdown


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


def test_report_keeps_the_generation_figures_when_the_push_fails_and_names_cut_parts():
    check = load_check()
    report = {"command": "python benchmarks/gpu_check.py", "date": "2026-12-04 00:00 UTC", "wall_s": 440.0,
              "tiny": False, "failed": ["generate-server push"], "budget_s": 450.0, "costs": "H200's x 1.5",
              "machine": {"python": "3.12", "torch": "2", "transformers": "5", "cpus": 16, "gpu": "GPU X",
                          "gpu_memory_gb": 85.0, "cuda": "13.0"},
              "models": {"choice": "policies: the tokenizer's 49,152 ids"},
              "estimates_s": {"generate-server": 300, "eval": 80},
              "part_wall_s": {"generate-server": 250.0, "eval": 30.0},
              "cut": {"eval": "stopped at the time budget's deadline after 30 s"},
              "parts": {"generate-server": {"model": "0.6B", "server_gpu": "CUDA_VISIBLE_DEVICES=1", "start_s": 90.0,
                                            "rollouts": 256, "prompt_tokens": 512, "sampled_tokens": 256,
                                            "generated": 65536, "seconds": 5.0, "tokens_per_s": 13107,
                                            "bound_share": 0.3, "push": {"error": "RuntimeError: NCCL error"}},
                        "eval": {"command": "eviback eval", "wall_s": 30.0, "cpu_s": 31.0, "exit": None,
                                 "cut": "stopped at the time budget's deadline after 30 s", "questions": 12,
                                 "placements": {"models": [], "not_on_device": []}}}}
    markdown = check.markdown(report)
    assert "**13,107 tokens/s**" in markdown and "Weight push: FAILED: RuntimeError: NCCL error" in markdown
    assert "on its own GPU (CUDA_VISIBLE_DEVICES=1)" in markdown
    assert "## Cut at the time budget" in markdown and "- eval: stopped at the time budget's deadline" in markdown
    assert "| eval | 80 | 30.0 | cut |" in markdown  # the time table: estimate against wall time
    assert "12 questions written" in markdown
    table = check.summary_table(report)
    assert "| generate-server | failed in part | 300 | 250 | 0.6B 13,107 tok/s (0.3 of bound), push FAILED |" in table
    assert "| eval | cut | 80 | 30 | cut: 12 questions written |" in table

    # a GPU the 4B step does not fit: not run, with the arithmetic of what was tried
    big, tried = check.choose_big_step(check.Sizes(tiny=False), 49152, 48 * 10**9)
    assert big is None
    report["parts"] = {"train-4b": {"skipped": "does not fit", "memory": {
        **tried[-1].to_dict(), "available": "of 48.0 GB", "tried": [m.to_dict() for m in tried], "fits": False}}}
    markdown = check.markdown(report)
    assert "none fits (`step_memory`), so the step was not run" in markdown
    assert "| beta=0, no reference model | 24.3 | 50.9 | 67.7 | **67.7** (optimizer step) |" in markdown
    assert "| eval | cut | 80 | 30 | cut: 12 questions written |" in table


def test_budget_refuses_work_the_time_left_does_not_cover_and_times_runs_by_it():
    check = load_check()
    clock = FakeClock(100.0)
    budget = check.Budget(deadline=400.0, clock=clock)
    assert budget.left() == 300.0 and budget.refusal(300.0) is None
    assert budget.refusal(301.0) == "not started: estimated 301 s, 300 s left of the time budget (--budget-s)"
    assert budget.run_limit() == (300.0, True)  # a run started now is killed at the deadline: cut, not failed
    clock.now = 500.0
    assert budget.left() == -100.0 and budget.refusal(0.5).endswith("0 s left of the time budget (--budget-s)")
    assert budget.run_limit() == (0.0, True)
    clock.now = 100.0
    assert check.Budget(deadline=400.0, clock=clock, cap_s=60.0).run_limit() == (60.0, False)  # --timeout-s first
    unlimited = check.Budget(deadline=None, clock=clock)
    assert unlimited.refusal(1e9) is None and unlimited.run_limit() == (check.NO_BUDGET_CAP_S, False)


def test_parts_start_only_when_their_estimate_fits_and_a_later_shorter_one_still_runs():
    check = load_check()
    clock = FakeClock()
    taken = {"a": 100.0, "big": 500.0, "boom": 10.0, "small": 50.0}

    def run(part: str) -> dict:
        clock.now += taken[part]
        if part == "boom":
            raise RuntimeError("broken")
        return {"ran": part}

    report = {"parts": {}, "part_wall_s": {}, "failed": []}
    done = []
    estimates = {"a": 120.0, "big": 400.0, "boom": 5.0, "small": 60.0, "late": 200.0}
    check.run_parts(["a", "big", "boom", "small", "late"], run, estimates,
                    check.Budget(deadline=300.0, clock=clock), report, after=done.append)
    parts = report["parts"]
    assert parts["a"] == {"ran": "a"} and parts["small"] == {"ran": "small"}
    assert parts["big"] == {"skipped": "not started: estimated 400 s, 200 s left of the time budget (--budget-s)"}
    assert parts["boom"] == {"error": "RuntimeError: broken"} and report["failed"] == ["boom"]
    assert parts["late"]["skipped"].startswith("not started: estimated 200 s, 140 s left")
    assert report["part_wall_s"] == {"a": 100.0, "boom": 10.0, "small": 50.0} and done == ["a", "boom", "small"]


def test_estimates_fit_the_default_budget_on_an_h100_and_cover_what_the_h200_took():
    check = load_check()
    sizes = check.Sizes(tiny=False)
    vocab = 49152
    h100, h200 = check.costs_for("NVIDIA H100 80GB HBM3"), check.costs_for("NVIDIA H200")
    assert h100.scale == check.OTHER_GPU_SCALE > h200.scale == 1.0 and check.costs_for(None) is check.CPU_COSTS

    def estimates(costs):
        return check.part_estimates(costs, sizes, vocab=vocab, presets=check.PRESETS, variants=list(check.VARIANTS),
                                    profile_steps=24)

    fast, slow = estimates(h200), estimates(h100)
    assert all(slow[p] == pytest.approx(fast[p] * 1.5) for p in check.PARTS)
    # the default order on an H100: the parts before generate fit the budget with the check's ~20 s start
    first = check.PARTS[:check.PARTS.index("generate")]
    assert 20 + sum(slow[p] for p in first) <= check.DEFAULT_BUDGET_S
    # the model reproduces what results/gpu.md measured on the H200, at or above it: grpo, 3 steps of 16 x 5 with
    # three turns of 150 tokens, 108.3 s; the 4B step (2 x 5, two turns of 400) took 54 s
    grpo = check.run_s(h200, "0.6B", vocab, steps=3, rollouts=80, turns=2, turn_tokens=150, checkpointing=False)
    assert 108.3 <= grpo <= 1.5 * 108.3
    step = check.run_s(h200, "4B", vocab, steps=2, rollouts=10, turns=1, turn_tokens=400, checkpointing=True) - \
        check.run_s(h200, "4B", vocab, steps=1, rollouts=10, turns=1, turn_tokens=400, checkpointing=True)
    assert 54 <= step <= 1.5 * 54
    # more work, a longer estimate
    longer = check.Sizes(tiny=False)
    longer.train_steps += 1
    assert check.preset_s(h100, "grpo", longer, vocab) > check.preset_s(h100, "grpo", sizes, vocab)
    assert check.preset_s(h100, "eviback", sizes, vocab) > check.preset_s(h100, "grpo", sizes, vocab)  # the judge


def test_4b_step_memory_is_the_sum_of_its_terms_and_picks_what_fits():
    check = load_check()
    shape, vocab = check.SHAPES["4B"], 49152
    params = check.parameters(check.shape_config(shape, vocab))
    assert params == 4_022_468_096 - (151936 - 49152) * 2560  # Qwen3-4B with the tokenizer's vocabulary
    common = dict(rollouts=10, rows=5, tokens=1212, scored=1058)
    with_ref = check.step_memory(shape, vocab, reference=True, **common)
    without = check.step_memory(shape, vocab, reference=False, **common)
    # AdamW's step: weights 4 + gradients 4 + moments 8 + engine 2 (+ the fp32 reference 4) bytes a parameter
    assert without.peak() == ("optimizer step", 18 * params)
    assert with_ref.peak() == ("optimizer step", 22 * params)
    # the update: weights, gradients, engine, autocast's bf16 weight cache (12 a parameter) and activations
    activations = without.phase_bytes("update") - 12 * params
    assert 3e9 < activations < 8e9
    assert without.later_update_bytes() == without.phase_bytes("update") + 8 * params
    # foreach AdamW's temporaries (a parameter group's size) with a bf16 reference: the 90 GB an H100 ran out of
    foreach = check.step_memory(shape, vocab, reference=True, reference_bytes=2, optimizer="foreach", **common)
    assert foreach.peak() == ("optimizer step", 24 * params) and round(24 * params / 1e9) == 90
    assert "optimizer step: weights fp32 15.0 + gradients fp32 15.0 + AdamW moments fp32 30.1 + engine copy bf16 " \
           "7.5 = 67.7 GB" in without.lines()
    # the trainer's own per-parameter rule (eviback.train.memory) holds the same terms
    from eviback.train.memory import trainer_bytes

    rule = trainer_bytes(accelerator=True, masters=False, reference=True)
    assert rule.peak_bytes(1) == 4 + 8 + 4 + 4 + 2  # weights, moments, reference, gradients, autocast copy
    with pytest.raises(ValueError, match="multiple of rows"):
        check.step_memory(shape, vocab, reference=False, rollouts=7, rows=5, tokens=10, scored=5)

    sizes = check.Sizes(tiny=False)
    big, tried = check.choose_big_step(sizes, vocab, 80 * 10**9)  # an H100: the reference does not fit
    assert big.beta == 0.0 and [m.reference for m in tried] == [True, False]
    assert big.memory.peak()[1] <= 0.9 * 80e9 and big.settings()["max_turn_tokens"] == sizes.big_turn_tokens
    big, tried = check.choose_big_step(sizes, vocab, 141 * 10**9)  # an H200: Search-R1's KL term
    assert big.beta == 0.001 and len(tried) == 1
    big, tried = check.choose_big_step(sizes, vocab, 48 * 10**9)
    assert big is None and len(tried) == 2  # skipped, with the arithmetic of both


def test_the_policy_server_takes_a_second_gpu_or_says_why_not():
    check = load_check()
    with pytest.raises(ValueError, match="Duplicate GPU detected.*; 1 here"):
        check.server_gpus(None, 1)
    assert check.server_gpus(None, 2) == "1"
    assert check.server_gpus("3, 5,7", 3) == "5"  # this process's second GPU, by its physical index
    with pytest.raises(ValueError, match="names fewer"):
        check.server_gpus("3", 2)


def wait_until_dead(stat: Path, within_s: float = 20.0) -> bool:
    """True once the process is gone or a zombie. SIGKILL is delivered asynchronously: for a moment after
    killpg returns, the killed process can still read as running (R) on its way out."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            if stat.read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                return True
        except (FileNotFoundError, ProcessLookupError):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def test_a_run_past_the_deadline_is_killed_with_its_children_and_marked_cut(tmp_path):
    check = load_check()
    # what the run wrote before the deadline: a step, and a line cut short by the kill
    (tmp_path / "metrics.jsonl").write_text('{"time/step": 1.0}\n{"time/st')
    child = tmp_path / "child.pid"
    # a run that starts a child of its own and never ends (a shell: it forks in milliseconds)
    stuck = ["sh", "-c", f"sleep 60 & echo $! > {child}; wait"]
    ctx = {"out": tmp_path, "env": dict(os.environ), "cwd": str(tmp_path),
           "budget": check.Budget(deadline=time.perf_counter() + 2.0)}
    result = check.run_logged("stuck", stuck, ctx)
    assert result["exit"] is None and "error" not in result and result["cut"].startswith("stopped at the time budget")
    assert check.read_jsonl(tmp_path / "metrics.jsonl") == [{"time/step": 1.0}]  # the cut-short line left out
    stat = Path(f"/proc/{int(child.read_text())}/stat")  # its own child went with it (the process group):
    assert wait_until_dead(stat), "the run's own child outlived the kill"
    capped = check.run_logged("capped", ["sleep", "60"], {**ctx, "budget": check.Budget(deadline=None, cap_s=0.5)})
    assert capped["error"] == "capped killed at its 0 s limit (--timeout-s)" and "cut" not in capped
    (tmp_path / "bad.jsonl").write_text('{"a": 1}\nnot json\n{"b": 2}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: not a JSON line"):
        check.read_jsonl(tmp_path / "bad.jsonl")  # only a last line may be cut short


def test_estimates_print_the_plan_of_a_gpu_by_name_without_running(capsys):
    check = load_check()
    assert check.main(["--estimates", "H100"]) == 0
    text = capsys.readouterr().out
    assert "train-4b memory on 80.0 GB (72.0 usable with a 10% margin)" in text
    assert "chosen: {'questions_per_step': 2, 'max_turns': 1, 'max_turn_tokens': 200, 'beta': 0.0}" in text
    assert check.main(["--estimates", "A100:40"]) == 0 and "nothing fits: the part is not run" in capsys.readouterr().out


def test_a_part_the_budget_does_not_cover_is_not_started(tmp_path):
    check = load_check()
    out = tmp_path / "out"
    assert check.main(["--tiny", "--parts", "peaks,eval", "--budget-s", "0", "--out", str(out),
                       "--work", str(tmp_path / "work")]) == 0
    report = json.loads((out / "gpu.json").read_text())
    assert report["budget_s"] == 0 and set(report["estimates_s"]) == {"peaks", "eval"}
    for part in ("peaks", "eval"):
        assert report["parts"][part]["skipped"].startswith("not started: estimated"), part
    assert "## Not run" in (out / "gpu.md").read_text()
