"""Build the trained evidence judge: a small classifier over all-MiniLM-L6-v2 that decides Stage A's status
(S/A/I).

  eviback build-judge                                   # from the embedded suite's training questions
  eviback build-judge --rollouts rollouts.jsonl         # plus real rollouts on training questions
  eviback build-judge --max-questions 200               # a smaller, quicker judge (the demo's)
  eviback build-judge --architecture cross-encoder --epochs 3   # the fine-tuned cross-encoder of builder 3

Examples come from training questions only (a question of an evaluation file is an error): real BM25
searches and same-topic negatives, plus the given rollouts (the warm-started actor's, so that the judge
learns the evidence it will judge). The judge reads each passage alone (S: holds a gold answer, A: a
supporting passage without it, I: neither) and calls the evidence I when no passage is relevant enough:
the threshold is calibrated on the training questions' own evidence (`--threshold 0`, the default; never on
the held-out questions) and kept in judge.json; its held-out figures (the gate, I vs not-I, S vs I and
kappa, on held-out questions' searches and rollouts) are printed and kept in its judge.json; a gate below 0.6 is reported WEAK (`eviback train` refuses such a judge
unless accept_weak_judge=true). The judge is saved under the cache (`$EVIBACK_CACHE/judges/evidence-judge-<key>`) and reused
by a later build with the same inputs. Its directory holds `policy.json`: the two-stage policy whose Stage A
is this judge (identified by the content hash of its files), ready for
`eviback judge DUMP --policy DIR/policy.json`, `eviback train --set teacher=DIR/policy.json` and E2E-APE.
"""

from __future__ import annotations

import argparse
import os

from eviback import dtype as dtypes
from eviback.train.judge_builder import EvidenceJudgeConfig, build_judge

HELP = "build the trained evidence judge for Stage A from training questions (cached)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = EvidenceJudgeConfig()
    # argparse expands `%` in help texts: the fields' own texts are literal
    fields = {name: {"help": f.metadata["help"].replace("%", "%%")}
              for name, f in EvidenceJudgeConfig.__dataclass_fields__.items() if "help" in f.metadata}
    parser.add_argument("--data", default=None, metavar="DIR", help=fields["data"]["help"])
    parser.add_argument("--train-files", nargs="+", default=[], metavar="NAME",
                        help=fields["train_files"]["help"])
    parser.add_argument("--rollouts", nargs="+", default=[], metavar="DUMP", help=fields["rollouts"]["help"])
    for name in ("max_questions", "topk", "max_observation_tokens", "passages_per_question", "max_length",
                 "batch_size", "seed"):
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name),
                            help=f"{fields[name]['help']} (default: %(default)s)")
    # the name of the option before it took the rollout's field name
    parser.add_argument("--max-obs-tokens", dest="max_observation_tokens", type=int, help=argparse.SUPPRESS)
    for name in ("balance_ratio", "heldout_share", "threshold", "epochs", "learning_rate"):
        parser.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(d, name),
                            help=f"{fields[name]['help']} (default: %(default)s)")
    parser.add_argument("--unit", choices=("passage", "evidence"), default=d.unit,
                        help=f"{fields['unit']['help']} (default: %(default)s)")
    parser.add_argument("--architecture", choices=("bi-encoder", "cross-encoder"), default=d.architecture,
                        help=f"{fields['architecture']['help']} (default: %(default)s)")
    parser.add_argument("--dtype", choices=dtypes.TRAINING_CHOICES, default=d.dtype,
                        help=f"{fields['dtype']['help']} (default: %(default)s)")
    parser.add_argument("--device", default=d.device, help=f"{fields['device']['help']} (default: %(default)s)")
    parser.add_argument("--base-model", default="", help=fields["base_model"]["help"])
    parser.add_argument("--actor-model", default=d.actor_model, help=f"{fields['actor_model']['help']} (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=None, help=fields["threads"]["help"])
    parser.add_argument("--output", default="", metavar="DIR", help=fields["output"]["help"])
    parser.add_argument("--force", action="store_true", help=fields["force"]["help"])


def config_from_args(args: argparse.Namespace) -> EvidenceJudgeConfig:
    return EvidenceJudgeConfig(
        data=args.data, train_files=tuple(args.train_files), rollouts=tuple(args.rollouts), unit=args.unit,
        architecture=args.architecture,
        threshold=args.threshold, dtype=args.dtype, device=args.device,
        max_questions=args.max_questions, topk=args.topk, max_observation_tokens=args.max_observation_tokens,
        passages_per_question=args.passages_per_question, balance_ratio=args.balance_ratio, heldout_share=args.heldout_share, base_model=args.base_model,
        actor_model=args.actor_model,
        max_length=args.max_length, epochs=args.epochs, batch_size=args.batch_size,
        learning_rate=args.learning_rate, seed=args.seed, threads=args.threads, output=args.output,
        force=args.force)


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see `eviback sft`: spinning threads on busy cores
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    judge = build_judge(config_from_args(args))  # its progress in the log, as eviback.train.judge_builder's lines
    print(f"evidence judge: {judge.path}")
    print(f"policy with the judge as Stage A: {judge.policy_path}")
    return 0
