"""The per-step records of a training run: one metrics.jsonl line per optimisation step, and the step's
groups (groups.jsonl, rollouts/).

Two sources meet here. The trainer hands over each step's rollouts as they are scored
(:meth:`StepLog.on_rollouts`, the trainer's `on_step`): their groups are logged at once and their rollout and
backoff metrics wait for the step's end. TRL then logs the step's loss, KL and gradient norm, which this
callback merges with them, with the step's time split, memory, and CPU gauges, into one record. Only the
main process writes.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from eviback.backoff import BackoffConfig
from eviback.train.gauges import cpu_gauges, cpu_snapshot, gpu_gauges, peak_rss_gb, process_gauges
from eviback.train.run import RunDir
from eviback.train.step_records import StepOutcome, compact_group_record, group_records, step_metrics

log = logging.getLogger("eviback.train.runner")  # the run's progress lines, under the runner's name as before

# TRL's log keys -> eviback's namespaced metric keys
TRL_KEYS = {"loss": "train/loss", "kl": "train/kl", "grad_norm": "train/grad_norm",
            "entropy": "train/entropy", "reward": "train/reward",
            "clip_ratio/region_mean": "train/clip_ratio", "step_time": "time/step",
            "completions/clipped_ratio": "rollout/length_cut_share",
            # |trainer log-prob - engine log-prob| over the sampled tokens (behaviour-policy mismatch)
            "sampling/sampling_logp_difference/mean": "train/engine_logp_diff_mean",
            "sampling/sampling_logp_difference/max": "train/engine_logp_diff_max",
            "sampling/importance_sampling_ratio/min": "train/is_ratio_min",
            "sampling/importance_sampling_ratio/mean": "train/is_ratio_mean",
            "sampling/importance_sampling_ratio/max": "train/is_ratio_max"}

# TRL's figures of the update itself: absent (None) in a step that ran no update (it kept no group)
_UPDATE_KEYS = ("loss", "kl", "grad_norm", "entropy", "clip_ratio/region_mean")

# Where the time of a step went outside the update (from the rollout metrics); the rest is the update.
_OUTSIDE_UPDATE = ("time/rollout", "time/retrieval", "time/teacher", "time/weight_sync")


class StepLog(TrainerCallback):
    """Merge TRL's per-step logs with the step's rollout metrics into one metrics.jsonl record.

    Args:
        run: the run directory written to.
        backoff: the run's advantage settings (the step metrics count the fallback groups by them).
        keep_rollout_steps: whole rollouts are kept for this many last steps (rollouts/).
        max_steps: for the progress line.
        processes: how many processes train (recorded in each line).
        main: whether this is the main process (the only one that writes).
    """

    def __init__(self, run: RunDir, backoff: BackoffConfig, *, keep_rollout_steps: int, max_steps: int,
                 processes: int, main: bool) -> None:
        self.run = run
        self.backoff = backoff
        self.keep_rollout_steps = keep_rollout_steps
        self.max_steps = max_steps
        self.processes = processes
        self.main = main
        self.pending: dict[int, dict[str, Any]] = {}  # step -> its rollout metrics, until TRL logs the step
        self.step_started = time.perf_counter()
        self.cpu_started = cpu_snapshot()

    def on_rollouts(self, outcome: StepOutcome) -> None:
        """The trainer's `on_step` (called on the main process only): log the step's groups now, keep its
        metrics for the step's record."""
        self.pending[outcome.step] = step_metrics(outcome, self.backoff)
        records = group_records(outcome)
        self.run.log_groups(compact_group_record(r) for r in records)
        self.run.log_rollouts(outcome.step, records, self.keep_rollout_steps)

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                      **kwargs: Any) -> None:
        self.step_started = time.perf_counter()
        self.cpu_started = cpu_snapshot()
        gpu_gauges()  # the peak counts from the step's start (the rollouts, the teacher and the update)

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if not self.main or not logs or "loss" not in logs:
            return
        record = self.pending.pop(state.global_step, {"step": state.global_step})
        skipped = record.get("train/update_skipped", False)
        for key, name in TRL_KEYS.items():
            if key in logs:
                # a step without update has no loss, KL or gradient: TRL's zeros would read as figures
                record[name] = None if skipped and key in _UPDATE_KEYS else logs[key]
        scheduler = kwargs.get("lr_scheduler")
        if scheduler is not None:
            record["train/learning_rate"] = scheduler.get_last_lr()[0]
        spent = sum(record.get(k) or 0.0 for k in _OUTSIDE_UPDATE)
        record["time/step"] = time.perf_counter() - self.step_started
        record["time/update"] = max(0.0, record["time/step"] - spent)
        record["memory/peak_rss_gb"] = round(peak_rss_gb(), 3)
        record.update(process_gauges())
        record.update(gpu_gauges())  # the step's peak GPU memory (none on a CPU run); reset for the next step
        record.update(cpu_gauges(self.cpu_started, cpu_snapshot()))  # was the machine this run's alone?
        record["run/dir_mb"] = self.run.size_mb()
        record["processes"] = self.processes
        self.run.log_metrics(record)
        loss = "no update (no group kept)" if skipped else f"loss {record.get('train/loss') or 0:.4f}"
        log.info("step %d/%d  em %.3f  all-zero %.2f  fallback %d (informative %d)  %s  %.0fs",
                 state.global_step, self.max_steps, record.get("rollout/em", 0),
                 record.get("backoff/all_zero_share", 0), record.get("backoff/fallback_groups", 0),
                 record.get("backoff/informative_fallback_groups", 0), loss, record["time/step"])
