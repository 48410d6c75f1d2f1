"""Where a training run's time and memory go: whole steps, and RSS per component.

Runs `eviback train` in this process (the `demo` preset by default; `--preset eviback` for the full
defaults; no held-out evaluation) with a sampler thread that reads this process's RSS every 50 ms, and wraps
the runner's loading steps to record the RSS around each: the generation engine (vLLM: weights + KV cache),
the policy (bf16 model + fp32 master weights), the trainer set-up (TRL's reference model), the teacher, and
each training step's phases (rollouts and TRL's reference pass; then the update and optimiser step). Writes
the timeline, the per-component split and the per-step records as JSON; the overall peak is the sampler's
maximum (what GNU time reports as maximum resident set size, measured from inside).

`--paths alternate` runs the update on TRL's own path (plain) on even steps and on eviback's fast path on
odd ones, in one run, so that whole steps (rollouts/s) compare under the same load; step 1 (warm-up) is
left out of the comparison. The process peak is then the plain path's.

    python benchmarks/bench_train_step.py --preset demo --out results/update/train_step_demo.json
    python benchmarks/bench_train_step.py --paths alternate --set max_steps=7 --out results/update/steps.json
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

log = logging.getLogger("bench_train_step")


def rss_gb() -> float:
    return psutil.Process().memory_info().rss / 1e9


class Sampler:
    """RSS every `every` seconds; `mark(label)` starts a new phase, whose peak is recorded."""

    def __init__(self, every: float = 0.05) -> None:
        self.every = every
        self.phases: list[dict] = []
        self.started = time.perf_counter()
        self.peak = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.mark("start")
        threading.Thread(target=self._run, daemon=True).start()

    def mark(self, label: str) -> None:
        now = rss_gb()
        with self._lock:
            self.phases.append({"phase": label, "t_s": round(time.perf_counter() - self.started, 2),
                                "rss_at_start_gb": round(now, 3), "peak_gb": now,
                                "load": [round(x, 2) for x in os.getloadavg()]})

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            now = rss_gb()
            with self._lock:
                self.peak = max(self.peak, now)
                self.phases[-1]["peak_gb"] = max(self.phases[-1]["peak_gb"], now)

    def stop(self) -> None:
        self._stop.set()
        self.mark("end")


def wrap(owner: object, name: str, sampler: Sampler, label: str, after: str | None = None) -> None:
    """Replace `owner.name` so that calling it starts phase `label` (and phase `after` when it returns)."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapped(*args, **kwargs):
        sampler.mark(label)
        try:
            return original(*args, **kwargs)
        finally:
            if after:
                sampler.mark(after)

    setattr(owner, name, wrapped)


def components(phases: list[dict]) -> dict[str, float]:
    """RSS growth over each loading phase (its end minus its start), GB."""
    out = {}
    for cur, nxt in zip(phases, phases[1:], strict=False):
        if cur["phase"].startswith("load:"):
            out[cur["phase"][5:]] = round(nxt["rss_at_start_gb"] - cur["rss_at_start_gb"], 3)
    return out


def compare(steps: list[dict]) -> dict:
    """Mean step and update seconds and rollouts/s per path, step 1 (warm-up) left out."""
    out: dict = {}
    for path in ("plain", "fast"):
        chosen = [s for s in steps if s["path"] == path and s["step"] > 1 and s.get("time/step")]
        if not chosen:
            continue
        step_s = sum(s["time/step"] for s in chosen) / len(chosen)
        rollouts = sum(s["rollout/trajectories"] or 0 for s in chosen) / len(chosen)
        out[path] = {"steps": [s["step"] for s in chosen], "step_s": round(step_s, 2),
                     "update_s": round(sum(s["time/update"] for s in chosen) / len(chosen), 2),
                     "rollouts_per_s": round(rollouts / step_s, 4)}
    if "plain" in out and "fast" in out:
        out["rollouts_per_s_ratio"] = round(out["fast"]["rollouts_per_s"] / out["plain"]["rollouts_per_s"], 3)
        out["update_s_ratio"] = round(out["plain"]["update_s"] / out["fast"]["update_s"], 3)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="demo")
    parser.add_argument("--set", action="append", default=[], help="key=value override of the preset")
    parser.add_argument("--paths", choices=("fast", "plain", "alternate"), default="fast")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

    import eviback.generation as generation
    from eviback.train import grpo, runner
    from eviback.train.config import resolve_config
    from eviback.train.scoring import ScoringSettings

    sampler = Sampler()
    wrap(generation, "load_backend", sampler, "load:engine", after="after-engine")
    wrap(runner, "load_policy_for_training", sampler, "load:policy_and_masters", after="after-policy")
    wrap(runner, "open_teacher", sampler, "load:teacher", after="after-teacher")
    wrap(grpo.EviBackTrainer, "__init__", sampler, "load:trainer_and_reference", after="after-trainer")
    wrap(grpo.EviBackTrainer, "_generate_and_score_completions", sampler, "step:rollout_reference",
         after="step:update")
    paths: dict[int, str] = {}
    choose = grpo.EviBackTrainer._generate_and_score_completions

    def choose_path(self, inputs):
        step = self.state.global_step + 1
        path = args.paths if args.paths != "alternate" else ("plain" if step % 2 == 0 else "fast")
        self.scoring = ScoringSettings() if path == "fast" else ScoringSettings.trl()
        paths[step] = path
        return choose(self, inputs)

    grpo.EviBackTrainer._generate_and_score_completions = choose_path
    wrap(grpo.EviBackTrainer, "_save_checkpoint", sampler, "checkpoint", after="step:after-checkpoint")

    config = resolve_config(args.preset, overrides=["eval_benchmarks=[]", *args.set])
    with tempfile.TemporaryDirectory() as tmp:
        result = runner.run_training(config, Path(tmp) / "run")
        metrics = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    sampler.stop()
    report = {
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "config": config.to_dict(),
        "peak_rss_gb": round(sampler.peak, 3),
        "components_gb": components(sampler.phases),
        "phases": [p | {"peak_gb": round(p["peak_gb"], 3)} for p in sampler.phases],
        "steps": [{"path": paths.get(m["step"])} | {k: m.get(k) for k in (
            "step", "time/step", "time/update", "time/rollout", "time/retrieval", "time/teacher",
            "time/weight_sync", "memory/peak_rss_gb", "rollout/generated_tokens", "rollout/trajectories")}
            for m in metrics],
    }
    report["comparison"] = compare(report["steps"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps({k: report[k] for k in ("peak_rss_gb", "components_gb", "comparison")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
