"""Plain GRPO vs EviBack vs DAPO filtering from the same warm start: training cost and held-out quality.

    python benchmarks/bench_backoff_experiment.py --out results/experiment --steps 8 \
        [--data DIR] [--presets grpo eviback dapo] [--set key=value ...]

Each preset trains in its own process (`eviback train`, so peak memory is per run) from the same cached
warm start, for the same number of steps on the same training questions, then is evaluated on the same
held-out questions (`eval_benchmarks`, never training ones). The script then writes:

- `<out>/<preset>/`: each run directory (metrics.jsonl, groups.jsonl, report, eval/);
- `<out>/warm-start/eval/`: the shared starting point (the warm start, before any GRPO step) evaluated on
  the same held-out questions with the same settings, as the reference row;
- `<out>/results.md` and `results.json`: per run, the mean step-time split (rollout, retrieval, teacher,
  weight sync, update), peak RSS, the all-zero share and the teacher calls (checked: the teacher judged
  exactly the rollouts of the all-zero groups), and the held-out metrics (EM, F1, valid-answer rate, average
  searches, duplicate-query rate, forced-termination rate);
- `<out>/comparison.png` and `comparison.html`: the training curves of the runs side by side.

Runs that already finished are reused (`--resume`), so the script can be rerun after an interruption.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

DEFAULT_SETTINGS = [
    "group_size=4", "questions_per_step=2", "max_turns=2", "max_turn_tokens=160", "max_obs_tokens=300",
    "save_steps=4", "learning_rate=2.0e-6", "eval_benchmarks=[nq,popqa,hotpotqa,2wikimultihopqa,musique]",
    "eval_limit=30",
]
TIME_KEYS = ("time/rollout", "time/retrieval", "time/teacher", "time/weight_sync", "time/update", "time/step")
EVAL_KEYS = ("em", "f1", "valid_answer_rate", "avg_searches", "duplicate_query_rate", "forced_termination_rate")


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def train(preset: str, out: Path, steps: int, data: str | None, extra: list[str]) -> None:
    settings = [*DEFAULT_SETTINGS, f"max_steps={steps}", *([f"data={data}"] if data else []), *extra]
    command = [sys.executable, "-m", "eviback.cli", "train", "--preset", preset, "--output", str(out / preset)]
    for item in settings:
        command += ["--set", item]
    if (out / preset / "config.yaml").exists():
        command.append("--resume")
    print("+", " ".join(command), flush=True)
    subprocess.run(command, check=True)


def evaluate_warm_start(out: Path, preset: str) -> None:
    """The held-out evaluation of the runs' common starting point, with the runs' own evaluation settings."""
    import yaml

    from eviback.evaluate import run_eval
    from eviback.train.config import TrainConfig
    from eviback.train.runner import held_out_eval_config, initial_policy

    target = out / "warm-start" / "eval"
    if (target / "summary.json").exists():
        return
    config = TrainConfig(**yaml.safe_load((out / preset / "config.yaml").read_text()))
    run_eval(held_out_eval_config(config, target, initial_policy(config)))


def summarize_eval(run: Path) -> dict:
    summary_path = run / "eval" / "summary.json"
    if not summary_path.exists():
        return {}
    summary = json.loads(summary_path.read_text())
    return {"eval": {name: summary[name] for name in ("overall", "single_hop", "multi_hop") if summary.get(name)},
            "eval_per_benchmark": {b["name"]: b["metrics"] for b in summary["benchmarks"]}}


def summarize_run(run: Path) -> dict:
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    groups = [json.loads(line) for line in (run / "groups.jsonl").read_text().splitlines()]
    all_zero_rollouts = sum(len(g["em"]) for g in groups if max(g["em"]) < 1)
    judged = sum(m.get("teacher/judged", 0) for m in metrics)
    row = {
        "steps": len(metrics),
        **{k: mean([m[k] for m in metrics if m.get(k) is not None]) for k in TIME_KEYS},
        "peak_rss_gb": max(m.get("memory/peak_rss_gb", 0) for m in metrics),
        "train_em": mean([m["rollout/em"] for m in metrics]),
        "all_zero_share": mean([m["backoff/all_zero_share"] for m in metrics]),
        "fallback_share": mean([m["backoff/fallback_share"] for m in metrics]),
        "teacher_judged": judged,
        "all_zero_rollouts": all_zero_rollouts,
        "teacher_calls": sum(m.get("teacher/calls", 0) for m in metrics),
        "teacher_errors": sum(m.get("teacher/errors", 0) for m in metrics),
    }
    return {**row, **summarize_eval(run)}


def markdown(rows: dict[str, dict], reference: dict) -> str:
    lines = ["## Training cost (means per step)", "",
             "| run | steps | rollout s | retrieval s | teacher s | sync s | update s | step s | peak RSS GB "
             "| all-zero share | teacher-reward share | teacher judged / all-zero rollouts | teacher calls |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        lines.append(
            f"| {name} | {r['steps']} | " + " | ".join(f"{r[k]:.1f}" for k in TIME_KEYS)
            + f" | {r['peak_rss_gb']:.2f} | {r['all_zero_share']:.2f} | {r['fallback_share']:.2f} "
            f"| {r['teacher_judged']} / {r['all_zero_rollouts']} | {r['teacher_calls']} |")
    lines += ["", "## Held-out evaluation (macro averages)", "",
              "| run | split | EM | F1 | valid answer | avg searches | duplicate queries | forced termination |",
              "|---|---|---|---|---|---|---|---|"]
    for name, r in {"warm start (step 0)": reference, **rows}.items():
        for split, m in r.get("eval", {}).items():
            lines.append(f"| {name} | {split} | " + " | ".join(f"{m[k]:.3f}" for k in EVAL_KEYS) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--data", help="data suite directory (default: the embedded one)")
    parser.add_argument("--presets", nargs="+", default=["grpo", "eviback", "dapo"])
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    for preset in args.presets:
        train(preset, args.out, args.steps, args.data, args.set)
    rows = {p: summarize_run(args.out / p) for p in args.presets}
    evaluate_warm_start(args.out, args.presets[0])
    reference = summarize_eval(args.out / "warm-start")
    for name, r in rows.items():
        if name.startswith("eviback") and r["teacher_judged"] != r["all_zero_rollouts"]:
            print(f"warning: {name}: the teacher judged {r['teacher_judged']} rollouts, "
                  f"the all-zero groups held {r['all_zero_rollouts']}", file=sys.stderr)
    (args.out / "results.json").write_text(json.dumps({"warm_start": reference, **rows}, indent=2) + "\n")
    (args.out / "results.md").write_text(markdown(rows, reference))
    from eviback.train.plots import write_report

    write_report([args.out / p for p in args.presets], args.out)
    (args.out / "report.html").rename(args.out / "comparison.html")
    print(markdown(rows, reference))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
