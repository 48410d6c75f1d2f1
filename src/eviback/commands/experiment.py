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
"""

from __future__ import annotations

import argparse

from eviback.experiment.config import load_experiment
from eviback.experiment.report import write_comparison
from eviback.experiment.run import run_experiment

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
        run_experiment(config, only=tuple(args.only), git_commit=args.commit, report=write_comparison)
    paths = write_comparison(config)
    print(paths[1].read_text())
    print(f"comparison: {paths[3]}")
    return 0
