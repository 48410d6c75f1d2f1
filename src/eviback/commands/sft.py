"""Warm-start the policy: fine-tune it on Search-R1 trajectories built from training questions.

  eviback sft                                  # ~200 examples from the embedded suite, cached
  eviback sft --max-examples 400 --epochs 2    # a larger warm start
  eviback sft --data DIR --train-files nq_oracle_train popqa_train --output runs/ws
  eviback sft --dry-run                        # build and count the examples, print one, train nothing
  eviback sft --help-config                    # every setting with its default

The examples come from the data suite's `train` files only (never its evaluation files; a training
question found in an evaluation file is an error). Searches are real: each trajectory searches the suite's
corpus (BM25 by default) and answers with a gold answer found in what it retrieved. The trained model is
saved under the cache (`$EVIBACK_CACHE/warmstart/<key>`, the key hashing the base model, the examples and
the settings) and reused by later runs with the same inputs; the command prints its directory, which
`--model` of the other commands accepts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

from eviback import device as devices
from eviback import dtype as dtypes
from eviback.commands import add_prompt_arguments, prompt_from_args
from eviback.policy import load_tokenizer, resolve_model
from eviback.settings import field_types, parse_setting_value
from eviback.train import sft
from eviback.train.sft import WarmStartConfig

HELP = "warm-start SFT on protocol trajectories built from training questions (cached)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = WarmStartConfig()
    parser.add_argument("--model", default=d.model, help="base policy: built-in name or model directory "
                        "(default: %(default)s)")
    parser.add_argument("--data", default=None, metavar="DIR", help="data suite (default: the embedded one)")
    parser.add_argument("--train-files", nargs="+", default=[], metavar="NAME",
                        help="a subset of the suite's training files, by name (nq_train) or path")
    parser.add_argument("--retriever", default=None, help="index directory or /retrieve URL (default: BM25 "
                        "over the suite's corpus)")
    parser.add_argument("--max-examples", type=int, default=d.max_examples, help="training examples "
                        "(default: %(default)s)")
    parser.add_argument("--multi-search-share", type=float, default=d.multi_search_share,
                        help="share of examples that search twice (default: %(default)s)")
    parser.add_argument("--max-observation-tokens", "--max-obs-tokens", dest="max_observation_tokens", type=int,
                        default=d.max_observation_tokens, help="observation cap, as in the rollouts "
                        "(default: %(default)s)")
    add_prompt_arguments(parser)  # as the rollouts will build the prompt
    parser.add_argument("--epochs", type=float, default=d.epochs, help="default: %(default)s")
    parser.add_argument("--lr", type=float, default=d.learning_rate, help="learning rate (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=d.batch_size, help="default: %(default)s")
    parser.add_argument("--grad-accum", type=int, default=d.gradient_accumulation,
                        help="gradient accumulation steps (default: %(default)s)")
    parser.add_argument("--dtype", choices=dtypes.TRAINING_CHOICES, default=d.dtype,
                        help="compute dtype; bfloat16 keeps an fp32 master copy; auto: bf16 where the device "
                             "computes it natively, else fp32 (default: %(default)s)")
    parser.add_argument("--device", default=d.device, help=devices.HELP + "; not in the cache key (default: "
                        "%(default)s)")
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: one per core)")
    parser.add_argument("--output", default=None, metavar="DIR", help="save here instead of the cache")
    parser.add_argument("--force", action="store_true", help="retrain even if a matching warm start is saved")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="any other setting (see --help-config), e.g. --set warmup_ratio=0.1")
    parser.add_argument("--dry-run", action="store_true", help="build the examples and print counts only")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--help-config", action="store_true", help="list every setting and exit")


def config_from_args(args: argparse.Namespace) -> WarmStartConfig:
    values = dict(
        model=args.model, data=args.data, train_files=list(args.train_files), retriever=args.retriever,
        max_examples=args.max_examples, multi_search_share=args.multi_search_share,
        max_observation_tokens=args.max_observation_tokens, prompt=prompt_from_args(args), epochs=args.epochs,
        learning_rate=args.lr,
        batch_size=args.batch_size, gradient_accumulation=args.grad_accum, dtype=args.dtype, device=args.device,
        seed=args.seed,
        threads=args.threads, output=args.output, force=args.force, progress=not args.no_progress,
    )
    types = field_types(WarmStartConfig)
    for item in args.set:
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in types:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE with KEY one of: {', '.join(sorted(types))}")
        values[key] = parse_setting_value(key, value, types[key])  # typed: names the setting when wrong
    return WarmStartConfig(**values)


def run(args: argparse.Namespace) -> int:
    # OpenMP threads that spin while waiting for each other collapse when the cores are shared: on two
    # busy cores a training step ran 10x slower with spinning threads than with sleeping ones. Must be set
    # before torch starts its thread pool; an explicit setting wins.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if args.help_config:
        print(sft.describe_fields())
        return 0
    config = config_from_args(args)
    if args.dry_run:
        return _dry_run(config)
    path = sft.warm_start(config)
    report = json.loads((path / sft.REPORT_FILE).read_text())
    ex, train = report["examples"], report["train"]
    print(f"examples: {ex['total']} ({ex['single']} single-search, {ex['multi']} multi-hop, {ex['retry']} "
          f"search-again)")
    print(f"training: {train['optimizer_steps']} steps, {train['seconds']:.0f} s, {train['tokens_per_second']:.0f} "
          f"tokens/s, mean loss {train['mean_loss']:.3f} (logged {train['first_loss']} -> {train['last_loss']}), "
          f"peak RSS {train['peak_rss_gb']} GB")
    print(f"warm-started model: {path}")
    return 0


def _dry_run(config: WarmStartConfig) -> int:
    tokenizer = load_tokenizer(resolve_model(config.model, "float32"))
    examples, report = sft.build_training_set(config, tokenizer)
    counts = {k.value: sum(e.kind is k for e in examples) for k in sft.wsd.ExampleKind}
    print(json.dumps({"selected": {"total": len(examples), **counts}, "build": dataclasses.asdict(report)},
                     indent=2))
    shown = next((e for e in examples if e.kind is not sft.wsd.ExampleKind.SINGLE), examples[0])
    print(f"\nexample ({shown.kind.value}, {shown.question.id}): {shown.question.question}")
    print(shown.trajectory.response)
    return 0
