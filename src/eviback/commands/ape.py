"""Build the teacher policy automatically from constraints (E2E-APE, EVIBACK.md section 5).

  eviback ape DUMP [DUMP ...] --out runs/ape                 the actor's rollouts on training questions
  eviback ape ... --spec my-spec.yaml                        your constraints (default: the packaged spec)
  eviback ape --write-spec my-spec.yaml                      copy the default spec to edit
  eviback ape ... --seed-policy JUDGE_DIR/policy.json        the trained evidence judge as a candidate too

The rollouts (a training run's rollouts/step-<N>.jsonl.gz; evaluation questions are refused) are labelled
by the evidence labels of eviback.teacher.labels and split by question into train / validation / sealed test. Candidate workflows (the seed
policies, systematic structural variants, and proposals of a controller LLM refined from training failures)
are rejected statically when gold could reach Stage A, then gated on the validation split (I overturned,
schema, errors, cost, canaries planted in gold, stability under reordered evidence, paraphrased questions and
repeated sampling, each on a lower confidence bound); the best feasible one on agreement with the
sufficiency labels wins, ties to the cheaper. The test split is opened once, for the comparison of the winner
with the manual single-prompt dual-task policy. The winner is frozen as OUT/teacher.json, loadable by
`eviback judge --policy OUT/teacher.json` and by `eviback train` (`teacher: OUT/teacher.json`).

OUT holds events.jsonl (append-only; rerun the same command to resume an interrupted run: nothing paid is
paid again, the replies are cached in OUT/cache.sqlite), spec.yaml, result.json and report.md.
Exit status: 0 with a frozen winner, 1 when no candidate passed the gates, 2 on a usage error.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from eviback import device as devices
from eviback import dtype as dtypes
from eviback.policy import DEFAULT_MODEL
from eviback.teacher import HttpBackendConfig, JudgeConfig, RetryConfig, TeacherConfig
from eviback.teacher.local import LocalBackendConfig
from eviback.teacher.openai_http import DEFAULT_BASE_URL

if TYPE_CHECKING:
    from eviback.ape.config import ApeConfig

# eviback.ape is imported when the command runs: it loads scipy (seconds), which `eviback --help` need not.

HELP = "construct the teacher policy from constraints (E2E-APE) and freeze the winner"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dumps", nargs="*", help="the actor's rollout dumps on training questions (a training run's "
                                                  "rollouts/step-<N>.jsonl.gz, or JSONL trajectories)")
    parser.add_argument("--out", help="run directory (rerun with the same --out to resume)")
    parser.add_argument("--spec", help="constraint spec YAML (default: the packaged default spec)")
    parser.add_argument("--write-spec", metavar="FILE", help="write the default spec to FILE and exit")
    parser.add_argument("--seed-policy", action="append", default=[], metavar="REF",
                        help="a policy to start from besides the spec's search.seeds (put first; repeatable), e.g. "
                             "the policy.json that `eviback build-judge` prints: the trained evidence judge as a "
                             "candidate")
    parser.add_argument("--suite", help="data suite whose evaluation questions are refused (default: the embedded "
                                        "one)")
    teacher = parser.add_argument_group("teacher backend")
    teacher.add_argument("--backend", choices=("local", "http"), default="local",
                         help="local: in-process transformers model; http: an OpenAI-compatible server")
    teacher.add_argument("--base-url", default=DEFAULT_BASE_URL,
                         help="teacher server URL (ends in /v1; default: %(default)s)")
    teacher.add_argument("--model", default="", help="served teacher model name (default: the server's first)")
    teacher.add_argument("--structured-output", default="response_format",
                         choices=("response_format", "structured_outputs", "json_object", "none"),
                         help="how the teacher server is asked for JSON (see `eviback judge --help`)")
    teacher.add_argument("--timeout", type=float, default=120.0, help="seconds per teacher call (default 120)")
    teacher.add_argument("--local-model", default=DEFAULT_MODEL, help="model of the local backends")
    teacher.add_argument("--dtype", default="auto", choices=dtypes.CHOICES,
                         help="dtype of the local backends' model (auto: bf16 where native, else fp32)")
    teacher.add_argument("--device", default="auto",
                         help="the local backends' model (teacher and controller): " + devices.HELP
                              + " (default: %(default)s)")
    teacher.add_argument("--threads", type=int, help="torch threads of the local backends")
    teacher.add_argument("--concurrency", type=int, default=8, help="rollouts judged at once (default 8)")
    teacher.add_argument("--max-attempts", type=int, default=3, help="attempts per stage call (default 3)")
    teacher.add_argument("--cache", default="cache.sqlite",
                         help="reply cache, relative to --out or absolute (default OUT/cache.sqlite)")
    control = parser.add_argument_group("controller")
    control.add_argument("--controller", choices=("local", "http", "none"), default="local",
                         help="the controller LLM: the local model (default), an OpenAI-compatible endpoint, "
                              "or none (seeds and systematic variants only)")
    control.add_argument("--controller-base-url", default=DEFAULT_BASE_URL,
                         help="controller server URL (default: %(default)s)")
    control.add_argument("--controller-model", default="", help="served controller model name")
    control.add_argument("--controller-api-key-env", default="OPENAI_API_KEY",
                         help="environment variable holding the controller's API key")


def run(args: argparse.Namespace) -> int:
    from eviback.ape.pipeline import run_ape
    from eviback.ape.report import comparison_rows
    from eviback.ape.spec import default_spec_text, load_spec

    if args.write_spec:
        path = Path(args.write_spec)
        if path.exists():
            raise FileExistsError(f"{path} exists; choose another file for the spec")
        path.write_text(default_spec_text(), encoding="utf-8")
        print(f"wrote the default E2E-APE spec to {path}; edit it and pass --spec {path}")
        return 0
    if not args.out:
        raise ValueError("give --out DIR for the run (or --write-spec FILE)")
    spec = load_spec(args.spec)
    if args.seed_policy:  # recorded in the run's spec.yaml like any seed
        seeds = tuple(dict.fromkeys((*args.seed_policy, *spec.search.seeds)))
        spec = dataclasses.replace(spec, search=dataclasses.replace(spec.search, seeds=seeds))
    config = _config(args)
    # its progress in the log, as eviback's lines (the library's default writes `[ape HH:MM:SS] ...` to stderr)
    result = run_ape(config, spec, progress=logging.getLogger("eviback.ape").info)
    winner = result.selection.winner if result.selection else None
    if result.test is not None:
        t = result.test
        print(f"\nsealed test: winner {t.winner} {t.winner_name} vs manual {t.baseline_name}")
        for metric, a, b in comparison_rows(t):
            print(f"  {metric:62s} {a:40s} {b}")
    if winner is None:
        print(f"eviback ape: no candidate passed every gate; see {config.out}/report.md for each reason", file=sys.stderr)
        return 1
    if not result.frozen_path:
        reasons = "; ".join(result.confirmation.reasons) if result.confirmation else "no sealed-test confirmation"
        print(f"eviback ape: nothing frozen: the sealed test did not confirm {winner}: {reasons}", file=sys.stderr)
        return 1
    print(f"\nwinner {winner}: frozen {result.frozen_path} version {result.frozen_version[:12]}\n"
          f"use it: eviback judge DUMP --policy {result.frozen_path}@{result.frozen_version[:12]}")
    return 0


def _config(args: argparse.Namespace) -> ApeConfig:
    from eviback.ape.config import ApeConfig, ControllerConfig

    teacher = TeacherConfig(
        backend=args.backend,
        http=HttpBackendConfig(base_url=args.base_url, model=args.model, structured_output=args.structured_output,
                               timeout_s=args.timeout, max_connections=max(args.concurrency, 1)),
        local=LocalBackendConfig(model=args.local_model, dtype=args.dtype, threads=args.threads,
                                 device=args.device),
        judge=JudgeConfig(concurrency=args.concurrency, retry=RetryConfig(max_attempts=args.max_attempts)),
        cache="",  # the run's own cache (ApeConfig.cache) is used
    )
    controller = ControllerConfig(
        kind=args.controller,
        http=HttpBackendConfig(base_url=args.controller_base_url, model=args.controller_model,
                               api_key_env=args.controller_api_key_env, structured_output="none",
                               timeout_s=args.timeout),
        local_model=args.local_model, dtype=args.dtype, device=args.device)
    return ApeConfig(out=args.out, dumps=tuple(args.dumps), suite=args.suite, teacher=teacher,
                     controller=controller, cache=args.cache)
