"""The run directory of `eviback train`: what a run writes, and how a killed run picks up again.

    runs/<name>/
      config.yaml      the resolved configuration (a resumed run must match it)
      metrics.jsonl    one record per optimisation step (namespaced keys, e.g. `rollout/em`)
      groups.jsonl     every group of every step: rollouts, EM, verdicts, rewards, advantages, fallback kind
      checkpoints/     TRL checkpoints (`checkpoint-<step>`), the resume points
      final/           the trained policy (safetensors + tokenizer)
      plots/*.png, report.html, eval/   training curves, the HTML report, the held-out evaluation

Logs are append-only. A run killed at any moment (SIGKILL included) resumes from its last checkpoint; the
log records of steps after that checkpoint are dropped on resume (those steps are redone), so every line
of the logs describes exactly one step of the final run.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from eviback.train.config import TrainConfig

# Settings that may change between a run and its resumption (they do not change what was already done).
RESUMABLE_CHANGES = frozenset({"max_steps", "save_steps", "save_total_limit", "eval_benchmarks", "eval_limit",
                               "teacher_url", "teacher_concurrency", "retriever"})


class RunDir:
    """Paths and append-only logs of one training run."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self.config_path = self.root / "config.yaml"
        self.metrics_path = self.root / "metrics.jsonl"
        self.groups_path = self.root / "groups.jsonl"
        self.checkpoints = self.root / "checkpoints"
        self.final = self.root / "final"
        self.plots = self.root / "plots"
        self.report = self.root / "report.html"
        self.eval_dir = self.root / "eval"

    # ---- configuration

    def start(self, config: TrainConfig, resume: bool) -> int | None:
        """Prepare the directory; returns the checkpoint step to resume from (None for a fresh run).

        A directory that already holds a run is resumed only with `resume=True`, and only with a matching
        configuration, so a typo never silently continues (or overwrites) another experiment."""
        self.root.mkdir(parents=True, exist_ok=True)
        if self.config_path.exists():
            if not resume:
                raise FileExistsError(
                    f"{self.root} already holds a run; pass --resume to continue it or choose another --output"
                )
            previous = yaml.safe_load(self.config_path.read_text())
            changed = {k for k, v in config.to_dict().items() if previous.get(k) != v} - RESUMABLE_CHANGES
            if changed:
                diffs = ", ".join(f"{k}: {previous.get(k)!r} -> {getattr(config, k)!r}" for k in sorted(changed))
                raise ValueError(f"cannot resume {self.root} with a different configuration ({diffs})")
        self.config_path.write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
        step = self.last_checkpoint_step()
        self.truncate_logs(step or 0)
        return step

    # ---- checkpoints

    def last_checkpoint(self) -> Path | None:
        """The newest complete checkpoint (TRL writes `trainer_state.json` last)."""
        best: tuple[int, Path] | None = None
        if self.checkpoints.exists():
            for path in self.checkpoints.iterdir():
                match = re.fullmatch(r"checkpoint-(\d+)", path.name)
                if match and (path / "trainer_state.json").exists():
                    step = int(match.group(1))
                    if best is None or step > best[0]:
                        best = (step, path)
        return best[1] if best else None

    def last_checkpoint_step(self) -> int | None:
        path = self.last_checkpoint()
        return int(path.name.split("-")[1]) if path else None

    # ---- logs

    def append(self, path: Path, records: Iterable[dict[str, Any]]) -> None:
        with open(path, "a", encoding="utf-8") as f:
            for record in records:
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def log_metrics(self, record: dict[str, Any]) -> None:
        self.append(self.metrics_path, [record])

    def log_groups(self, records: Iterable[dict[str, Any]]) -> None:
        self.append(self.groups_path, records)

    def truncate_logs(self, step: int) -> None:
        """Keep only the records of steps <= `step` (a torn last line from a kill is dropped too)."""
        for path in (self.metrics_path, self.groups_path):
            if not path.exists():
                continue
            kept = []
            for line in path.read_text(encoding="utf-8").splitlines():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue  # the line a kill interrupted
                if record.get("step", 0) <= step:
                    kept.append(line)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
            os.replace(tmp, path)

    def read_metrics(self) -> list[dict[str, Any]]:
        return read_records(self.metrics_path)

    def read_groups(self) -> list[dict[str, Any]]:
        return read_records(self.groups_path)


def read_records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
