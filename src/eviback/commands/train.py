"""Train a search agent with GRPO and evidence-constrained teacher backoff.

  eviback train --preset eviback --output runs/eviback
  eviback train --preset grpo --set max_steps=50 --set lam=0.5 --output runs/grpo
  eviback train --config my.yaml --output runs/x --resume      # continue a killed or finished run
  eviback train --help-config                                  # every setting, its default and meaning

Presets: eviback (two-stage teacher, lambda 0.1), grpo (plain GRPO, Search-R1), dapo (zero-variance groups
dropped), f1-fallback (all-zero groups get the actor's own token F1, no teacher), eviback-single-prompt (the
manual single-prompt dual-task teacher), eviback-oracle (the ceiling: a teacher that reads the gold answers),
demo (CPU-sized). Several processes or GPUs: `accelerate launch -m eviback.cli train ...` (TRL handles the
distribution; each process rolls out and judges its own whole groups).
"""

from __future__ import annotations

import argparse

HELP = ("train with GRPO + teacher backoff (presets: eviback, grpo, dapo, f1-fallback, eviback-single-prompt, "
        "eviback-oracle, demo)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="eviback", help="starting values (default: eviback)")
    parser.add_argument("--config", help="YAML file of settings (applied after the preset)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override one setting (repeatable), e.g. --set lam=0.5")
    parser.add_argument("--output", help="run directory (default: runs/<preset>)")
    parser.add_argument("--resume", action="store_true", help="continue the run in --output from its last checkpoint")
    parser.add_argument("--help-config", action="store_true", help="list every setting and exit")


def run(args: argparse.Namespace) -> int:
    from eviback.train.config import describe_fields, resolve_config

    if args.help_config:
        print(describe_fields())
        return 0
    config = resolve_config(args.preset, args.config, args.set)
    from eviback.train.runner import run_training

    result = run_training(config, args.output or f"runs/{args.preset}", resume=args.resume)
    if result.eval_summary is not None:
        from eviback.evaluate import comparison_markdown

        tables = {"start": result.start_summary} if result.start_summary is not None else {}
        print(comparison_markdown({**tables, "trained": result.eval_summary}, title="Held-out evaluation"))
    print(f"run: {result.run_dir}\nmodel: {result.final_model}\nreport: {result.report}")
    return 0
