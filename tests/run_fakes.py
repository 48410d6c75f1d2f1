"""A training run directory as a stopped run leaves it, for the tests of the paragraphs `eviback train` prints
when a run stops (a service that stopped answering, a full disk): logged steps and a complete checkpoint."""

from __future__ import annotations

from pathlib import Path

from eviback.train.run import RunDir


def stopped_run_dir(root: Path, logged: int, checkpoint: int | None) -> RunDir:
    """`root` made a run directory that logged steps 1..`logged` and holds a complete checkpoint (one with
    `trainer_state.json`, written last) at step `checkpoint`, or none."""
    run = RunDir(root)
    run.root.mkdir()
    for step in range(1, logged + 1):
        run.log_metrics({"step": step})
    if checkpoint is not None:
        (run.checkpoints / f"checkpoint-{checkpoint}").mkdir(parents=True)
        (run.checkpoints / f"checkpoint-{checkpoint}" / "trainer_state.json").write_text("{}")
    return run
