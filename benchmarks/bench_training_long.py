"""What a long run must keep flat, and how far the engine's log-probs are from the trainer's.

    python benchmarks/bench_training_long.py soak --steps 200 --out results/training/soak.json
    python benchmarks/bench_training_long.py mismatch --steps 4 --out results/training/mismatch.json

`soak` runs `eviback train` (the demo preset with small settings, so that 200 steps fit in about an hour on
2 cores: the demo's cached warm start (so the demo's observation cap, part of its cache key), 1 question x 2
rollouts per step, 64-token turns, the local two-stage teacher with its trained evidence judge and its
SQLite reply cache, a checkpoint every 20 steps) and reports, from the run's
metrics.jsonl, the open file descriptors, the resident memory and the run directory's size at steps 1, 50,
100 and 200, plus the largest value after step 50 (growth after warm-up is what a leak looks like).

`mismatch` runs the demo preset twice for a few steps from the same warm start and seed, with the
behaviour-policy correction off (`is_correction=false`: the difference is measured, every ratio is 1) and
on (the default), and reports per step the mean and max |trainer log-prob - engine log-prob| over the
sampled tokens and the importance ratios. The difference is a property of the two engines' numerics; the
correction does not change it, it weights the loss by the capped ratio.

Both write raw JSON (every metrics line of every run, with the command) and print a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

SOAK_SETTINGS = [
    "group_size=2", "questions_per_step=1", "max_turn_tokens=64", "save_steps=20",
    "save_total_limit=2", "eval_benchmarks=[]", "keep_rollout_steps=10",
]
GAUGES = ("process/open_fds", "memory/rss_gb", "memory/peak_rss_gb", "run/dir_mb", "time/step")
MISMATCH_KEYS = ("train/engine_logp_diff_mean", "train/engine_logp_diff_max", "train/is_ratio_min",
                 "train/is_ratio_mean", "train/is_ratio_max", "rollout/em", "train/kl", "time/step")


def train(out: Path, settings: list[str]) -> tuple[list[dict], list[str], float]:
    command = [sys.executable, "-m", "eviback.cli", "train", "--preset", "demo", "--output", str(out)]
    for item in settings:
        command += ["--set", item]
    if out.exists():
        command.append("--resume")
    started = time.perf_counter()
    subprocess.run(command, check=True, env={**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1"})
    wall = time.perf_counter() - started
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return metrics, command, wall


def soak(args: argparse.Namespace) -> dict:
    run = args.work / "soak"
    settings = [*SOAK_SETTINGS, f"max_steps={args.steps}"]
    if args.report_only:  # the figures of a run in progress or stopped early, from its metrics.jsonl
        metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
        command, wall = ["eviback", "train", "--preset", "demo", *(f"--set {s}" for s in settings)], float("nan")
    else:
        metrics, command, wall = train(run, settings)
    by_step = {m["step"]: m for m in metrics}
    marks = [s for s in (1, 50, 100, 150, 200, args.steps, max(by_step)) if s in by_step]
    table = {str(s): {k: by_step[s].get(k) for k in GAUGES} for s in dict.fromkeys(marks)}
    later = [m for m in metrics if m["step"] >= min(50, args.steps)]
    return {
        "command": " ".join(command), "steps": len(metrics), "wall_s": round(wall, 1),
        "at_steps": table,
        "max_after_step_50": {k: max((m.get(k) or 0) for m in later) for k in GAUGES if k != "time/step"},
        "engine_logp_diff": [{"step": m["step"], "mean": m.get("train/engine_logp_diff_mean"),
                              "max": m.get("train/engine_logp_diff_max"), "is_ratio_mean": m.get("train/is_ratio_mean"),
                              "is_ratio_max": m.get("train/is_ratio_max")} for m in metrics],
        "metrics": metrics,
        "load_avg": os.getloadavg(),
    }


def mismatch(args: argparse.Namespace) -> dict:
    runs = {}
    for name, correction in (("correction_off", "false"), ("correction_on", "true")):
        metrics, command, wall = train(args.work / name, [f"max_steps={args.steps}", f"is_correction={correction}",
                                                         "eval_benchmarks=[]"])
        runs[name] = {"command": " ".join(command), "wall_s": round(wall, 1),
                      "per_step": [{"step": m["step"], **{k: m.get(k) for k in MISMATCH_KEYS}} for m in metrics],
                      "metrics": metrics}
    return {"runs": runs, "load_avg": os.getloadavg()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("part", choices=("soak", "mismatch"))
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--work", type=Path, default=Path("runs/bench-training"), help="run directories")
    parser.add_argument("--out", type=Path, required=True, help="raw JSON")
    parser.add_argument("--report-only", action="store_true", help="soak: report the run in --work as it is "
                        "(in progress or stopped), without training")
    args = parser.parse_args(argv)
    result = soak(args) if args.part == "soak" else mismatch(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    summary = {k: v for k, v in result.items() if k not in ("metrics", "runs")}
    if "runs" in result:
        summary["per_step"] = {name: r["per_step"] for name, r in result["runs"].items()}
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
