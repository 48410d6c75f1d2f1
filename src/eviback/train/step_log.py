"""The per-step records of a training run: one metrics.jsonl line per optimisation step, and the step's
groups (groups.jsonl, rollouts/).

Two sources meet here. The trainer hands over each step's rollouts as they are scored
(:meth:`StepLog.on_rollouts`, the trainer's `on_step`): their groups are logged at once and their rollout and
backoff metrics wait for the step's end. TRL then logs the step's loss, KL and gradient norm, which this
callback merges with them, with the step's time split, memory, CPU gauges and, at a validation step, the
validation's figures (:mod:`eviback.train.validation`, :meth:`StepLog.add_figures`), into one record. Only the
main process writes.

The same record reaches the run's `report_to` integrations (wandb, tensorboard, trackio, ...): the callback
adds its figures, by their metrics.jsonl names, to the Trainer's log of the step before those integrations read
it (:func:`tracker_figures`; :func:`log_first` puts the callback ahead of them), so a tracker shows every figure
metrics.jsonl holds, under the same name, at the same step.
"""

from __future__ import annotations

import logging
import numbers
import time
from collections.abc import Mapping
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
_OUTSIDE_UPDATE = ("time/rollout", "time/retrieval", "time/teacher", "time/weight_sync", "time/validation")

# Figures of a record that the Trainer's log holds already under TRL's or transformers' own name (metrics.jsonl
# name -> the log's key): a tracker is not sent them twice while they are the same number.
_LOGGED_AS = {**{name: key for key, name in TRL_KEYS.items()}, "train/learning_rate": "learning_rate"}


def tracker_figures(record: Mapping[str, Any], logs: Mapping[str, Any]) -> dict[str, float | int]:
    """What a step's metrics.jsonl `record` adds to the Trainer's `logs` of that step for the `report_to`
    integrations: every number of the record under its metrics.jsonl name, booleans as 0/1; left out are `step`
    (an integration takes the step from the Trainer's state), None and anything not a number (trackers take
    scalars), and a figure `logs` holds already as the same number under TRL's name (`loss` for `train/loss`)."""
    out: dict[str, float | int] = {}
    for name, value in record.items():
        if name == "step" or not isinstance(value, numbers.Real):
            continue
        key = _LOGGED_AS.get(name)
        if key is not None and logs.get(key) == value:
            continue
        out[name] = int(value) if isinstance(value, bool) else value
    return out


def log_first(trainer: Any, callback: Any) -> None:
    """Make `callback` (one of `trainer`'s) the first the Trainer calls on each event, so that what it adds to a
    step's log (:meth:`StepLog.on_log`) is there when the `report_to` integrations, added before it by the
    Trainer, read the same dict."""
    callbacks = trainer.callback_handler.callbacks
    callbacks.remove(callback)
    callbacks.insert(0, callback)


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

    def add_figures(self, step: int, figures: Mapping[str, Any]) -> None:
        """Put `figures` (namespaced, e.g. a validation's `val/em`) into the record of step `step`, written when
        TRL logs that step (main process)."""
        self.pending.setdefault(step, {"step": step}).update(figures)

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
        if "learning_rate" in logs:
            # the rate this step's update used: transformers reads it before stepping the scheduler, whose
            # get_last_lr() here is already the next step's (one step late during a warm-up)
            record["train/learning_rate"] = float(logs["learning_rate"])
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
        # the integrations (report_to) read this same dict after this callback (log_first): every figure of the
        # line just written reaches them, at this step
        logs.update(tracker_figures(record, logs))
        loss = "no update (no group kept)" if skipped else f"loss {record.get('train/loss') or 0:.4f}"
        log.info("step %d/%d  em %.3f  all-zero %.2f  fallback %d (informative %d)  %s  %.0fs",
                 state.global_step, self.max_steps, record.get("rollout/em", 0),
                 record.get("backoff/all_zero_share", 0), record.get("backoff/fallback_groups", 0),
                 record.get("backoff/informative_fallback_groups", 0), loss, record["time/step"])
