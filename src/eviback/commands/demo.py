"""The main job on the embedded data, end to end, sized for a 2-core CPU (about 20 minutes the first time).

  eviback demo                      # warm start -> a few EviBack GRPO steps -> held-out evaluation
  eviback demo --steps 8 --output runs/demo-long

1. Warm start: SmolLM2-135M is fine-tuned on Search-R1 trajectories built from the embedded *training*
   questions with real BM25 searches (cached: a second demo skips it).
2. EviBack GRPO: a few steps of one training question and 8 rollouts; all-zero groups are judged by the
   two-stage teacher, in process (no server needed): Stage A by the trained evidence judge (the bi-encoder
   judge built from 200 training questions on the first demo, its threshold calibrated, then cached; `--set
   teacher_stage_a=prompted` keeps the prompted SmolLM2 Stage A), Stage B extractive: the span of the
   evidence the actor saw that best matches the gold (`--set teacher_stage_b=prompted`: SmolLM2, grounded).
3. Evaluation on held-out questions (NQ, PopQA, HotpotQA of the embedded suite), greedy, with the metrics
   table printed and an HTML report (training curves, evaluation, trajectories turn by turn).
4. What happened, in a few sentences (also at the top of the report): how many groups had a verified hit,
   fell back and got a signal from the teacher, and the most any evidence judge could have told apart; the
   judge's gate; the held-out change with paired bootstrap intervals, and whether they include 0.

The log holds eviback's own lines and progress bars; known, harmless third-party warnings are silenced
where they are emitted (`eviback.log_format`), and `eviback -v demo` shows every line.

The demo's settings are the `demo` preset (`eviback train --help-config` explains each); `--set` changes
any of them.

Sized by what the CPU computes natively: the preset fits about 20 minutes on a CPU with native bf16
(AVX512-BF16 or AMX). On a CPU without it (AVX2 only, like most laptops) `dtype: auto` computes in fp32,
which measured about half as fast for the warm start (85 against 176 tokens/s, results/precision.md), so
the demo runs fewer steps and evaluates fewer questions there (:data:`NO_NATIVE_BF16`), says so before it
starts, and `--full` keeps the preset's sizes. A setting given with `--set` is never changed.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
from pathlib import Path

from eviback.commands.train import print_summary
from eviback.device import place
from eviback.dtype import DtypeChoice
from eviback.evaluate import comparison_markdown
from eviback.train.config import TrainConfig, resolve_config
from eviback.train.runner import run_training, teacher_is_oracle

HELP = "run the main job on the embedded data: warm start, EviBack GRPO steps, held-out evaluation"

# The demo's sizes where `dtype: auto` computes in fp32 on a CPU (no native bf16), from `make demo` measured on
# the AVX2 path (results/demo.md, section 8: 23 minutes): fewer steps and held-out questions. The warm start
# keeps the preset's 100 examples, those of the warm start whose precondition was measured (results/precondition.md).
NO_NATIVE_BF16 = {"max_steps": 6, "eval_limit": 20}


def size_for_this_machine(config: TrainConfig, choice: DtypeChoice,
                          given: set[str]) -> tuple[TrainConfig, str | None]:
    """(config, message): the demo's config sized for this machine, and one plain sentence saying what was
    changed and why (None when nothing was). Pure: `choice` is the `eviback.dtype` decision, `given` the
    settings the user set explicitly (never changed)."""
    if config.dtype != "auto" or choice.device != "cpu" or choice.dtype != "float32":
        return config, None
    changes = {k: v for k, v in NO_NATIVE_BF16.items() if k not in given and getattr(config, k) > v}
    if not changes:
        return config, None
    before = ", ".join(f"{k} {getattr(config, k)} -> {v}" for k, v in changes.items())
    message = (f"this CPU computes bf16 slowly ({choice.reason}), so the demo computes in float32, about half "
               f"as fast as on the bf16 CPUs it was sized for; to stay near its 20-25 minutes it does less work: "
               f"{before} (eviback demo --full keeps the preset's sizes)")
    return dataclasses.replace(config, **changes), message


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output", default="runs/demo", help="run directory (replaced on each demo run)")
    parser.add_argument("--steps", type=int, help="GRPO steps (default: the demo preset's)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a setting of the demo preset, e.g. --set backend=hf")
    parser.add_argument("--resume", action="store_true", help="continue an interrupted demo instead of restarting")
    parser.add_argument("--full", action="store_true", help="keep the preset's sizes on a CPU without native bf16 "
                        "too (by default the demo trains less there: about twice as slow in fp32)")


def run(args: argparse.Namespace) -> int:
    overrides = list(args.set) + ([f"max_steps={args.steps}"] if args.steps else [])
    config = resolve_config("demo", None, overrides)  # a bad setting stops here, before anything heavy loads
    if not args.full:
        given = {item.split("=", 1)[0].strip() for item in overrides}
        config, sized = size_for_this_machine(config, place(config.device, config.dtype).dtype_choice, given)
        if sized:
            print(f"eviback demo: {sized}", flush=True)
    if teacher_is_oracle(config):
        raise ValueError(f"the demo refuses the oracle teacher {config.teacher.policy!r}: it reads the gold answers to "
                         f"decide the status, a ceiling for experiments, never the demo's teacher. Measure it with "
                         f"`eviback train --preset eviback-oracle`")
    output = Path(args.output)
    if output.exists() and not args.resume:
        if not (output / "config.yaml").exists():
            raise FileExistsError(f"{output} exists and is not a demo run; choose another --output")
        shutil.rmtree(output)
    evaluation = (f"then evaluation on {', '.join(config.eval_benchmarks)} ({config.eval_limit} held-out questions "
                  f"each)" if config.eval_benchmarks else "no held-out evaluation (eval_benchmarks is empty)")
    print(f"eviback demo: warm start (cached after the first run), {config.max_steps} EviBack GRPO steps "
          f"({config.questions_per_step} question{'' if config.questions_per_step == 1 else 's'} x "
          f"{config.rollout.group_size} rollouts), {evaluation}", flush=True)
    result = run_training(config, output, resume=args.resume)
    if result.eval_summary is not None:
        print()
        tables = {"start": result.start_summary} if result.start_summary is not None else {}
        print(comparison_markdown({**tables, "trained": result.eval_summary},
                                  title="Held-out evaluation: the warm start (start) and after EviBack training"))
    print_summary(result.run_dir)
    print(f"\nrun directory: {result.run_dir}")
    print(f"report:        {result.report}")
    print(f"trajectories:  {result.run_dir / 'eval' / 'viewer.html'}")
    return 0

