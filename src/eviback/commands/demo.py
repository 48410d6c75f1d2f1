"""The main job on the embedded data, end to end, sized for a 2-core CPU (about 20 minutes the first time).

  eviback demo                      # warm start -> a few EviBack GRPO steps -> held-out evaluation
  eviback demo --steps 8 --output runs/demo-long

1. Warm start: SmolLM2-135M is fine-tuned on Search-R1 trajectories built from the embedded *training*
   questions with real BM25 searches (cached: a second demo skips it).
2. EviBack GRPO: a few steps with group size 4 on training questions; all-zero groups are judged by the
   two-stage teacher, in process (no server needed): Stage A by the trained evidence judge (a small
   cross-encoder built from 200 training questions on the first demo, then cached; `--set
   teacher_stage_a=prompted` keeps the prompted SmolLM2 Stage A), Stage B extractive: the span of the
   evidence the actor saw that best matches the gold (`--set teacher_stage_b=prompted`: SmolLM2, grounded).
3. Evaluation on held-out questions (NQ, PopQA, HotpotQA of the embedded suite), greedy, with the metrics
   table printed and an HTML report (training curves, evaluation, trajectories turn by turn).

The demo's settings are the `demo` preset (`eviback train --help-config` explains each); `--set` changes
any of them.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

HELP = "run the main job on the embedded data: warm start, EviBack GRPO steps, held-out evaluation"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output", default="runs/demo", help="run directory (replaced on each demo run)")
    parser.add_argument("--steps", type=int, help="GRPO steps (default: the demo preset's)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a setting of the demo preset, e.g. --set backend=hf")
    parser.add_argument("--resume", action="store_true", help="continue an interrupted demo instead of restarting")


def run(args: argparse.Namespace) -> int:
    from eviback.train.config import resolve_config
    from eviback.train.runner import run_training, teacher_is_oracle

    overrides = list(args.set) + ([f"max_steps={args.steps}"] if args.steps else [])
    config = resolve_config("demo", None, overrides)
    if teacher_is_oracle(config):
        raise ValueError(f"the demo refuses the oracle teacher {config.teacher!r}: it reads the gold answers to "
                         f"decide the status, a ceiling for experiments, never the demo's teacher. Measure it with "
                         f"`eviback train --preset eviback-oracle`")
    output = Path(args.output)
    if output.exists() and not args.resume:
        if not (output / "config.yaml").exists():
            raise FileExistsError(f"{output} exists and is not a demo run; choose another --output")
        shutil.rmtree(output)

    from eviback.evaluate import comparison_markdown

    print(f"eviback demo: warm start (cached after the first run), {config.max_steps} EviBack GRPO steps "
          f"({config.questions_per_step} questions x {config.group_size} rollouts), then evaluation on "
          f"{', '.join(config.eval_benchmarks)} ({config.eval_limit} held-out questions each)", flush=True)
    result = run_training(config, output, resume=args.resume)
    if result.eval_summary is not None:
        print()
        tables = {"start": result.start_summary} if result.start_summary is not None else {}
        print(comparison_markdown({**tables, "trained": result.eval_summary},
                                  title="Held-out evaluation: the warm start (start) and after EviBack training"))
    print(f"\nrun directory: {result.run_dir}")
    print(f"report:        {result.report}")
    print(f"trajectories:  {result.run_dir / 'eval' / 'viewer.html'}")
    return 0
