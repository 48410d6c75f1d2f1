"""The trainers' step bar without their per-step log lines.

transformers' `ProgressCallback`, which TRL's trainers use, draws the step bar and also prints every logged
dict (`{'loss': '8.478e-08', 'grad_norm': ..., 'completions/mean_length': ...}`, 30-odd raw metric names a
step, then `{'train_runtime': ...}`) under it. eviback logs its own line per step (`train.step_log`) and
writes every figure to `metrics.jsonl`, so those dicts only bury the lines that matter. :func:`keep_bar_only`
swaps the callback for one that draws the same bar and prints no dict, and drops the `PrinterCallback` that
prints the same dicts to stdout when the bars are off (`--no-progress`); with `-v` the dicts stay.

    trainer = SFTTrainer(...)
    keep_bar_only(trainer)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from eviback.log_format import verbose

if TYPE_CHECKING:
    from transformers import TrainerControl, TrainerState, TrainingArguments


def keep_bar_only(trainer: Any) -> None:
    """Replace `trainer`'s ProgressCallback (if it has one) by one that prints no log dict, and remove its
    PrinterCallback (what `disable_tqdm` puts in the bar's place: it prints each dict); nothing changes with
    `-v`."""
    from transformers.trainer_callback import PrinterCallback, ProgressCallback  # only once a trainer exists

    class StepBar(ProgressCallback):
        """ProgressCallback without the dict it prints on each log."""

        def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                   logs: dict[str, float] | None = None, **kwargs: object) -> None:
            return None

    if verbose():
        return
    if any(isinstance(c, PrinterCallback) for c in trainer.callback_handler.callbacks):
        trainer.remove_callback(PrinterCallback)
    if any(isinstance(c, ProgressCallback) for c in trainer.callback_handler.callbacks):
        trainer.remove_callback(ProgressCallback)
        trainer.add_callback(StepBar())
