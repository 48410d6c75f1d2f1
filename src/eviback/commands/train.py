"""Train a search agent with GRPO and evidence-constrained teacher backoff.

  eviback train --preset eviback --output runs/eviback
  eviback train --preset grpo --set max_steps=50 --set lam=0.5 --output runs/grpo
  eviback train --config my.yaml --output runs/x --resume      # continue a killed or finished run
  eviback train --help-config                                  # every setting, its default and meaning

Presets: eviback (two-stage teacher, lambda 0.1), grpo (plain GRPO, Search-R1), dapo (zero-variance groups
dropped), f1-fallback (all-zero groups get the actor's own token F1, no teacher), eviback-single-prompt (the
manual single-prompt dual-task teacher), eviback-oracle (the ceiling: a teacher that reads the gold answers),
demo (CPU-sized). Several processes or GPUs: `accelerate launch -m eviback.cli train ...` (TRL handles the
distribution; each process rolls out and judges its own whole groups).

With `retriever=http://...`, a retrieval service that stops answering (a restart, a reload) is waited for,
retried with backoff, for `retrieval_deadline_s` seconds (default 300). Past that the run stops with one
paragraph naming the service, its last error, what is redone and the `--resume` command that continues the
run, and exit code 75 (`-v` shows the traceback). With `backend=vllm-server`, a policy server that stops
answering stops the run the same way at once (a restarted server holds other weights than the run's last
push, so it is not waited for); `--resume` pushes the checkpoint's weights into the restarted server.

A checkpoint takes several times the policy's weights (1.9 GB for the 135M policy). Before the first step the
run's disk is checked: too small for one checkpoint, the run is refused; too small for all it may write, a
warning. A disk that fills anyway stops the run with exit 75 and a paragraph saying what --resume redoes from
the last complete checkpoint (docs/training.md, "When the disk fills").
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from eviback.cache import cache_dir
from eviback.disk import free_space, full_disk_error, gigabytes, size_on_disk
from eviback.evaluate import comparison_markdown
from eviback.retrieval.client import RetrieverUnavailable
from eviback.train.config import TrainConfig, describe_fields, resolve_config
from eviback.train.report_summary import summary_text
from eviback.train.run import RunDir
from eviback.train.runner import run_training
from eviback.unavailable import RESUMABLE_EXIT, ServiceUnavailable

HELP = ("train with GRPO + teacher backoff (presets: eviback, grpo, dapo, f1-fallback, eviback-single-prompt, "
        "eviback-oracle, demo)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="eviback", help="starting values (default: eviback)")
    parser.add_argument("--config", help="YAML file of settings (applied after the preset)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override one setting (repeatable), e.g. --set lam=0.5")
    parser.add_argument("--output", help="run directory (default: runs/<preset>)")
    parser.add_argument("--resume", action="store_true", help="continue the run in --output from its last checkpoint")
    parser.add_argument("--help-config", action="store_true", help="list every setting and exit")


def run(args: argparse.Namespace) -> int:
    if args.help_config:
        print(describe_fields())
        return 0
    config = resolve_config(args.preset, args.config, args.set)
    output = args.output or f"runs/{args.preset}"
    try:
        result = run_training(config, output, resume=args.resume)
    except Exception as e:
        if getattr(args, "verbose", False):
            raise
        unavailable = ServiceUnavailable.found_in(e)
        full = full_disk_error(e)
        if unavailable is not None:
            print(stop_message(unavailable, config, output, resume_command(args, output)), file=sys.stderr)
            return leave(unavailable.exit_code)
        if full is not None:
            print(disk_full_message(full, config, output, resume_command(args, output)), file=sys.stderr)
            return leave(RESUMABLE_EXIT)
        raise
    if result.eval_summary is not None:
        tables = {"start": result.start_summary} if result.start_summary is not None else {}
        print(comparison_markdown({**tables, "trained": result.eval_summary}, title="Held-out evaluation"))
    if result.main:
        print_summary(result.run_dir)
    print(f"run: {result.run_dir}\nmodel: {result.final_model}\nreport: {result.report}")
    return 0


def leave(code: int) -> int:
    """How a stopped run ends: in one process, by returning `code`. Under a launcher (torchrun, accelerate
    launch) the other processes may be waiting in a collective this one will never join: this process exits at
    once with `code`, without the interpreter's shutdown (which would tear down the process group, and with
    NCCL can wait on the others), so that the launcher sees it end and stops the rest instead of leaving them
    to the collective's timeout. The launcher itself then reports the run as failed; the paragraph above says
    how to resume it."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def print_summary(run_dir: Path) -> None:
    """What the run did, in the sentences that open its report (eviback.train.report_summary)."""
    print("\n## What happened (the top of the report)\n")
    print(summary_text(run_dir))


def resume_command(args: argparse.Namespace, output: str) -> str:
    """The `eviback train` command that continues this run: its own preset, config file and settings, its
    output directory, and `--resume`."""
    words = ["eviback", "train"]
    if args.preset != "eviback":
        words += ["--preset", args.preset]
    if args.config:
        words += ["--config", args.config]
    for item in args.set:
        words += ["--set", item]
    words += ["--output", output, "--resume"]
    return shlex.join(words)


def progress(run: RunDir) -> tuple[int, int | None]:
    """(the last step the run logged, 0 for none; its last complete checkpoint's step, or None)."""
    logged = [m["step"] for m in run.read_metrics() if "step" in m]
    return max(logged, default=0), run.last_checkpoint_step()


# Where a run stopped before its first step, and what --resume redoes then: the same for every cause.
BEFORE_FIRST_STEP = ("before its first step was done (in the warm start, or the first rollouts)",
                     "--resume starts it over, reusing a finished warm start")


def starts_over(config: TrainConfig, checkpoint: int | None, none_yet: str) -> str | None:
    """What --resume redoes when the run has nothing to continue from (`none_yet`: the kind of checkpoint it
    lacks); None when it has a checkpoint."""
    if not config.save_steps:
        return "the run writes no checkpoints (save_steps=0), so --resume starts it over"
    if checkpoint is None:
        return f"it had no {none_yet} yet, so --resume starts it over"
    return None


def stop_message(error: ServiceUnavailable, config: TrainConfig, output: str, command: str) -> str:
    """One paragraph for a run stopped by a service that stopped answering (the retrieval service, past its
    deadline; the policy server): the service, its last error, where the run stopped, what `--resume` redoes
    (the steps since the last checkpoint) and `command`, which continues it."""
    done, checkpoint = progress(RunDir(output))
    if done == 0 and checkpoint is None:
        where, redone = BEFORE_FIRST_STEP
    elif done >= config.max_steps:
        where = f"after its last step ({done} of {config.max_steps}), in the final evaluation"
        redone = "--resume redoes only the evaluation's unfinished questions"
    else:
        where = f"in step {done + 1} of {config.max_steps}"
        if over := starts_over(config, checkpoint, "checkpoint"):
            redone = over
        elif checkpoint >= done:
            redone = f"--resume continues from its checkpoint at step {checkpoint}: only step {done + 1} is redone"
        else:
            redone = (f"--resume continues from its last checkpoint, step {checkpoint} (save_steps="
                      f"{config.save_steps}): steps {checkpoint + 1}-{done + 1} are redone")
    launch = launched_as_before()
    if isinstance(error, RetrieverUnavailable):
        patience = (f"; `--set retrieval_deadline_s=SECONDS` (now {config.retrieval_deadline_s:g}) waits longer for a "
                    "service that is slow to load its index")
    else:
        patience = (f", which pushes the run's weights into the restarted server before its first rollout; "
                    f"`--set policy_timeout_s=SECONDS` (now {config.engine.policy_timeout_s:g}) waits longer for a server "
                    "that is only slow")
    return (f"eviback train: {error.describe()}, so the run stopped {where}; {redone}. Once the "
            f"{error.service.removeprefix('the ')} answers again ({error.restart()}), continue the run with "
            f"`{command}`{launch}{patience}.")


def launched_as_before() -> str:
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    return f" (launched as before, {processes} processes)" if processes > 1 else ""


def disk_full_message(error: BaseException, config: TrainConfig, output: str, command: str) -> str:
    """One paragraph for a run stopped by a full disk (or quota), most likely while writing a checkpoint or the
    final model: the error, the space left and what one checkpoint takes, where the run stopped, what
    `--resume` redoes (from the last complete checkpoint) and `command`, which continues it."""
    run = RunDir(output)
    done, checkpoint = progress(run)
    if done == 0 and checkpoint is None:
        where, redone = BEFORE_FIRST_STEP
    elif done >= config.max_steps and checkpoint == done:
        where = f"after its last step ({done} of {config.max_steps}), writing the final model or evaluating it"
        redone = "--resume writes the final model again and evaluates it, with no step redone"
    else:
        where = f"after step {done} of {config.max_steps}"
        if over := starts_over(config, checkpoint, "complete checkpoint"):
            redone = over
        elif checkpoint >= done:
            redone = f"--resume continues from its checkpoint at step {checkpoint}, with no step redone"
        else:
            steps = f"step {done} is" if checkpoint + 1 == done else f"steps {checkpoint + 1}-{done} are"
            redone = f"--resume continues from its last complete checkpoint, step {checkpoint}: {steps} redone"
    sizes = ""
    last = run.last_checkpoint()
    if last is not None:
        sizes = f"; one checkpoint of this run takes {gigabytes(size_on_disk(last))}"
    partial = run.incomplete_checkpoints()
    if partial:
        names = ", ".join(str(p) for p in partial)
        sizes += (f"; {names} did not finish saving ({gigabytes(sum(size_on_disk(p) for p in partial))}) and can be "
                  "deleted")
    # the run directory's disk, or the cache's (the warm start, the judge) where that is another one
    free = free_space({"the run directory": run.root, "the cache": cache_dir()})
    return (f"eviback train: a disk is full ({type(error).__name__}: {error}), so the run {run.root} stopped "
            f"{where}; {redone}. {free[0].upper()}{free[1:]}{sizes}. Free space (or keep fewer checkpoints: `--set "
            f"save_total_limit=1`, now {config.save_total_limit}), then continue the run with `{command}`"
            f"{launched_as_before()}.")
