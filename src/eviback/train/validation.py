"""Validation during training: held-out questions evaluated every `val_every` optimisation steps.

    eviback train --preset eviback --set val_every=10 --set val_benchmarks=[nq,hotpotqa] --set val_limit=20

Each validation is the held-out evaluation itself (:func:`eviback.evaluate.run_eval`: greedy, one rollout a
question, the run's turn and token limits), run on the run's own generation engine with the weights of the step
just trained: the policy is pushed into the engine first (a vLLM engine on a GPU is woken for it and put back to
sleep after it), so a validation costs its rollouts and one weight push, and no second engine or model load.

When: at the end of every step whose number is a multiple of `val_every` (transformers' `on_step_end`), after the
optimiser step and before the step is logged and checkpointed. Its figures (:func:`validation_figures`: `val/em`,
`val/f1`, ..., `val/<benchmark>/em`) join that step's metrics.jsonl line, and so the trackers and the report;
its items go to `val/step-<N>/` (eviback eval's files), of which the newest `keep_rollout_steps` are kept.

Several processes: the main process alone validates, the others wait for it at a barrier (no collective runs
inside a validation: the weight push is the main process's alone, even into a policy server every process shares).

Resuming: a validation belongs to its step. Its figures are written with the step's line, before the step's
checkpoint, so a run killed during a validation (or after it, before the checkpoint) redoes the step and its
validation from the last checkpoint, and the line is written once. The redone validation starts its directory
afresh: the items of an interrupted one came from weights the redone step may not reproduce.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import shutil
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from eviback.evaluate import EvalConfig, EvalSummary, run_eval
from eviback.generation.base import GenerationBackend, sleep_backend, wake_backend
from eviback.log_format import verbose
from eviback.retrieval.base import Retriever

if TYPE_CHECKING:
    from eviback.train.config import TrainConfig

log = logging.getLogger("eviback.train.runner")  # the run's progress lines, under the runner's name

VAL_DIR = "val"  # in the run directory: val/step-<N>/, one validation's items and summary
_STEP_DIR = re.compile(r"step-(\d+)")


class Processes(Protocol):
    """What a validation needs of the process group (accelerate's PartialState or Accelerator)."""

    @property
    def is_main_process(self) -> bool: ...

    def wait_for_everyone(self) -> None: ...


def validation_due(step: int, every: int) -> bool:
    """Whether the step numbered `step` (1-based, as TRL counts) ends with a validation (`every` 0: never)."""
    return every > 0 and step > 0 and step % every == 0


def validation_benchmarks(config: TrainConfig) -> tuple[str, ...]:
    """The benchmarks each validation evaluates: `val_benchmarks`, else the final evaluation's."""
    return tuple(config.val_benchmarks or config.eval_benchmarks)


def validation_limit(config: TrainConfig) -> int:
    """Questions per benchmark in each validation: `val_limit`, else the final evaluation's `eval_limit`."""
    return config.val_limit or config.eval_limit


def step_dir(root: Path, step: int) -> Path:
    """The directory of the validation after step `step`: `<root>/step-<N>` (N zero-padded, so they sort)."""
    return Path(root) / f"step-{step:06d}"


def validation_figures(summary: EvalSummary) -> dict[str, float]:
    """One validation's figures, namespaced for metrics.jsonl: the macro averages over its benchmarks
    (`val/em`, `val/f1`, `val/sub_em`, `val/valid_answer_rate`, `val/avg_searches`,
    `val/forced_termination_rate`; `val/questions`, the total evaluated) and each benchmark's EM and F1
    (`val/<benchmark>/em`, `val/<benchmark>/f1`)."""
    overall = summary.overall
    figures: dict[str, float] = {
        "val/em": overall.em, "val/f1": overall.f1, "val/sub_em": overall.sub_em,
        "val/valid_answer_rate": overall.valid_answer_rate, "val/avg_searches": overall.avg_searches,
        "val/forced_termination_rate": overall.forced_termination_rate, "val/questions": overall.n,
    }
    for row in summary.benchmarks:
        figures[f"val/{row.name}/em"] = row.metrics.em
        figures[f"val/{row.name}/f1"] = row.metrics.f1
    return figures


def prune_validations(root: Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` validation directories under `root` (0: every one); returns those
    deleted. Their figures stay in metrics.jsonl: only the items (whole trajectories) go."""
    if not root.exists():
        return []
    dirs = sorted(p for p in root.iterdir() if p.is_dir() and _STEP_DIR.fullmatch(p.name))
    old = dirs[:-keep] if keep > 0 else dirs
    for path in old:
        shutil.rmtree(path)
    return old


class Validation(TrainerCallback):
    """Evaluate the held-out questions at the end of every `every`-th step (see the module's docstring).

    Args:
        every: validate after each step whose number is a multiple of it (>= 1).
        eval_config: the validation's evaluation (benchmarks, limit, rollout limits, backend name); its `out` is
            the root of the validation directories (`<run>/val`), each validation writing `step-<N>` under it.
        backend: the run's generation engine (the one the trainer pushes weights into).
        retriever: the run's retriever.
        push: puts the policy of the step just trained into `backend` (the main process's push alone, outside
            any collective: `EviBackTrainer.push_policy`).
        record: takes (step, figures) into that step's metrics.jsonl line (`StepLog.add_figures`).
        processes: the process group; only its main process validates, the others wait for it.
        keep: validation directories kept (the newest); 0: none once its figures are recorded.
    """

    def __init__(self, *, every: int, eval_config: EvalConfig, backend: GenerationBackend, retriever: Retriever,
                 push: Callable[[], None], record: Callable[[int, Mapping[str, Any]], None], processes: Processes,
                 keep: int) -> None:
        if every < 1:
            raise ValueError(f"Validation needs every >= 1, got {every}")
        self.every = every
        self.eval_config = eval_config
        self.root = Path(eval_config.out)
        self.backend = backend
        self.retriever = retriever
        self.push = push
        self.record = record
        self.processes = processes
        self.keep = keep

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        step = state.global_step
        if not validation_due(step, self.every):
            return
        if self.processes.is_main_process:
            self.record(step, self.validate(step))
        # the other processes wait here, outside any collective of the step, until the main process is done
        self.processes.wait_for_everyone()

    def validate(self, step: int) -> dict[str, float]:
        """One validation of the weights of step `step`: push, evaluate, put the engine back to sleep. Returns its
        figures (:func:`validation_figures`) with `time/validation`, the seconds it took (the push included)."""
        started = time.perf_counter()
        self.push()
        wake_backend(self.backend)  # vLLM on a GPU: its KV cache back for the evaluation (a no-op elsewhere)
        # the evaluation's own two lines (questions to run, throughput) would repeat at every validation: the line
        # below says what a validation did (-v shows them)
        evaluation_log = logging.getLogger("eviback.evaluate")
        level = evaluation_log.level
        if not verbose():
            evaluation_log.setLevel(logging.WARNING)
        try:
            out = step_dir(self.root, step)
            # overwrite: a directory of this step is that of an interrupted earlier try of the step (the step is
            # being redone from an earlier checkpoint), whose items the weights now may not reproduce
            summary = run_eval(dataclasses.replace(self.eval_config, out=str(out)), overwrite=True,
                               backend=self.backend, retriever=self.retriever)
        finally:
            evaluation_log.setLevel(level)
            sleep_backend(self.backend)  # the memory back to the trainer before the next step's update
        prune_validations(self.root, self.keep)
        figures = {**validation_figures(summary), "time/validation": time.perf_counter() - started}
        log.info("validation after step %d: EM %.3f  F1 %.3f  valid answer %.2f  on %d held-out questions  %.0fs",
                 step, figures["val/em"], figures["val/f1"], figures["val/valid_answer_rate"],
                 summary.overall.n, figures["time/validation"])
        return figures


def validation_eval_config(config: TrainConfig, base: EvalConfig) -> EvalConfig:
    """The evaluation every validation of a run repeats: `base` (the run's held-out evaluation: its rollout limits,
    engine and prompt, `out` the root of the validation directories) on the validation's benchmarks and limit,
    quietly (the step bar is on the terminal)."""
    return dataclasses.replace(base, benchmarks=validation_benchmarks(config), limit=validation_limit(config),
                               progress=False)
