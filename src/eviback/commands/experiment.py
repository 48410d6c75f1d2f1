"""Run a comparison of training recipes from one experiment file, arm by arm, and write the comparison.

  eviback experiment experiments/cpu.yaml --data DIR            # every run not yet done, then the comparison
  eviback experiment experiments/cpu.yaml --data DIR --commit   # commit each finished run as it finishes
  eviback experiment experiments/cpu.yaml --only eviback        # only these arms' runs
  eviback experiment experiments/cpu.yaml --report-only         # redraw the comparison from what is done

Every run starts from the same cached warm start and trains in its own `eviback train` process; a finished
run is kept in the file's `out` directory (metrics, compressed groups, evaluation items and summary; no
checkpoints) and never redone, an interrupted one resumes from its checkpoint. The comparison (paired
differences against the baseline arm with bootstrap intervals over items and seeds, per-step curves, HTML)
is redrawn after every finished run. See docs/experiment.md.

A run (or the warm start's evaluation) whose process fails stops the experiment with one line after the run's
own message: the finished runs are kept, and the same command goes on. Its exit status is the run's 75 (a
service that stopped answering, a full disk: nothing is lost) or 1.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys

from eviback.experiment.config import load_experiment
from eviback.experiment.report import write_comparison
from eviback.experiment.run import run_experiment
from eviback.unavailable import RESUMABLE_EXIT

HELP = "run the arms x seeds of an experiment file and compare them on held-out questions"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="experiment YAML file (e.g. experiments/cpu.yaml)")
    parser.add_argument("--data", metavar="DIR", help="data suite of every run (default: the file's settings.data, "
                        "else the embedded suite); recorded as $DATA with the files' hashes, not as a path")
    parser.add_argument("--only", nargs="+", default=[], metavar="ARM", help="run only these arms")
    parser.add_argument("--commit", action="store_true", help="git-commit each finished run and the comparison")
    parser.add_argument("--report-only", action="store_true", help="write the comparison of the finished runs")


def run(args: argparse.Namespace) -> int:
    config = load_experiment(args.config, data=args.data)
    if not args.report_only:
        try:
            run_experiment(config, only=tuple(args.only), git_commit=args.commit, report=write_comparison)
        except subprocess.CalledProcessError as e:  # the process said why, above; here only what it means
            if getattr(args, "verbose", False):
                raise
            print(f"eviback experiment: {stopped(e)}, so the experiment stopped. The runs it finished are kept in "
                  f"{config.out}; run the same command again to go on (an unfinished run resumes from its last "
                  "checkpoint).", file=sys.stderr)
            return RESUMABLE_EXIT if e.returncode == RESUMABLE_EXIT else 1
    paths = write_comparison(config)
    print(paths[1].read_text())
    print(f"comparison: {paths[3]}")
    return 0


def stopped(error: subprocess.CalledProcessError) -> str:
    """How a child process ended, for a person."""
    command = shlex.join(str(c) for c in error.cmd) if isinstance(error.cmd, (list, tuple)) else str(error.cmd)
    how = f"was killed by signal {-error.returncode}" if error.returncode < 0 else f"exited {error.returncode}"
    return f"`{command}` {how} (its own message is above)"
