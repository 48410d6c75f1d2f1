"""The run directory of `eviback train`: what a run writes, and how a killed run picks up again.

    runs/<name>/
      config.yaml      the resolved configuration (a resumed run must match it)
      metrics.jsonl    one record per optimisation step (namespaced keys, e.g. `rollout/em`)
      groups.jsonl     one compact line per group of every step: EM, verdicts, rewards, advantages, fallback
                       kind, and per rollout its answer, queries, passage ids and stop reason (no texts)
      rollouts/        `step-<step>.jsonl.gz`: the same groups with whole rollouts (model text, observations,
                       passages), for the last `keep_rollout_steps` steps only, so the directory stays bounded
      teacher.json     the teacher policy's name, version and evidence-boundary verdict (EviBack runs)
      start.json       the starting policy (the warm start): its directory name and a hash of its weights
      dtype.json       the compute dtype `dtype` resolved to on this machine, and why (eviback.dtype)
      checkpoints/     TRL checkpoints (`checkpoint-<step>`), the resume points
      final/           the trained policy (safetensors + tokenizer)
      plots/*.png, report.html, eval/   training curves, the HTML report, the held-out evaluation
      eval-start/      the starting policy (the warm start) on the same held-out questions

Logs are append-only. A run killed at any moment (SIGKILL included) resumes from its last checkpoint; the
log records of steps after that checkpoint are dropped on resume (those steps are redone), so every line
of the logs describes exactly one step of the final run. The process training a directory holds a lock on
it (`.lock`, released when the process ends, however it ends): a second `eviback train` on the same
directory is refused instead of truncating the logs the first one is writing.
"""

from __future__ import annotations

import gzip
import json
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml
from filelock import FileLock, Timeout

from eviback.disk import size_on_disk
from eviback.train.config import TrainConfig

# Settings that may change between a run and its resumption (they do not change what was already done).
RESUMABLE_CHANGES = frozenset({"max_steps", "save_steps", "save_total_limit", "eval_benchmarks", "eval_limit",
                               "eval_warm_start", "keep_rollout_steps", "teacher_url", "teacher_concurrency",
                               "retriever", "retrieval_deadline_s", "policy_url", "policy_timeout_s",
                               "gpu_memory_utilization", "vllm_sleep_level", "vllm_executor", "val_every"})

# Settings added after runs had been made whose default is not what those runs did: the value a run whose
# config.yaml lacks the key ran with (a resumed run is compared with it, not with today's default).
EARLIER_BEHAVIOUR = {"teacher_stage_b": "prompted", "judge_architecture": "cross-encoder"}

# The run directories this process holds the lock of (resolved path -> the held lock).
_HELD: dict[str, FileLock] = {}


def _write_holder(fd: int) -> None:
    """Write this process's pid into the lock file `fd` it has just locked (for the message of a refused one)."""
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()}\n".encode(), 0)


class RunDir:
    """Paths and append-only logs of one training run."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self.config_path = self.root / "config.yaml"
        self.metrics_path = self.root / "metrics.jsonl"
        self.groups_path = self.root / "groups.jsonl"
        self.rollouts = self.root / "rollouts"
        self.teacher_path = self.root / "teacher.json"
        self.start_path = self.root / "start.json"
        self.dtype_path = self.root / "dtype.json"
        self.checkpoints = self.root / "checkpoints"
        self.final = self.root / "final"
        self.plots = self.root / "plots"
        self.report = self.root / "report.html"
        self.eval_dir = self.root / "eval"
        self.eval_start_dir = self.root / "eval-start"
        self.lock_path = self.root / ".lock"

    def lock(self) -> None:
        """Hold the directory's lock until `unlock` or the end of this process (the OS drops it however the
        process ends, SIGKILL included). Raises RuntimeError, naming the holder, while another process holds
        it. Re-entrant within a process (a run retried in the same process takes the lock it holds)."""
        key = str(self.root.resolve())
        if key in _HELD:
            return
        self.root.mkdir(parents=True, exist_ok=True)
        # An OS lock on the file (flock): the kernel drops it when the process ends. The holder writes its pid
        # into the locked file, so that a refused process can say who holds it.
        lock = FileLock(self.lock_path, thread_local=False, on_acquired=_write_holder)
        try:
            lock.acquire(timeout=0)
        except Timeout:
            holder = self.lock_path.read_text().strip() or "another process"
            raise RuntimeError(f"{self.root} is being trained by {holder}; stop it first (a killed run "
                               f"resumes with --resume)") from None
        _HELD[key] = lock

    def unlock(self) -> None:
        """Release the lock `lock` took (nothing when this process does not hold it)."""
        lock = _HELD.pop(str(self.root.resolve()), None)
        if lock is not None:
            lock.release(force=True)

    # ---- configuration

    def start(self, config: TrainConfig, resume: bool) -> int | None:
        """Prepare the directory; returns the checkpoint step to resume from (None for a fresh run).

        A directory that already holds a run is resumed only with `resume=True`, and only with a matching
        configuration, so a typo never silently continues (or overwrites) another experiment. From here on
        this process holds the directory's lock (`lock`): another process training it is refused."""
        self.lock()
        if self.config_path.exists():
            if not resume:
                raise FileExistsError(
                    f"{self.root} already holds a run; pass --resume to continue it or choose another --output"
                )
            previous = yaml.safe_load(self.config_path.read_text())
            # A setting the earlier run's file does not name did not exist then: it ran with its default, or
            # with what the code did before the setting existed.
            defaults = {**type(config)().to_dict(), **EARLIER_BEHAVIOUR}
            settings = config.to_dict()
            ran = {k: previous.get(k, defaults[k]) for k in settings}
            changed = {k for k, v in settings.items() if ran[k] != v} - RESUMABLE_CHANGES
            if changed:
                was = {k: ran[k] for k in sorted(changed)}
                diffs = ", ".join(f"{k}: {was[k]!r} -> {settings[k]!r}" for k in was)
                as_set = " ".join(f"--set {k}={_as_override(v)}" for k, v in was.items())
                raise ValueError(f"cannot resume {self.root} with a different configuration ({diffs}); to "
                                 f"continue it as it ran: {as_set}")
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

    def incomplete_checkpoints(self) -> list[Path]:
        """Checkpoint directories whose save did not finish (no `trainer_state.json`): never resumed from."""
        if not self.checkpoints.exists():
            return []
        return sorted(p for p in self.checkpoints.iterdir()
                      if re.fullmatch(r"checkpoint-\d+", p.name) and not (p / "trainer_state.json").exists())

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

    def log_rollouts(self, step: int, records: Iterable[dict[str, Any]], keep: int) -> None:
        """Write the step's whole rollouts to `rollouts/step-<step>.jsonl.gz` and delete all but the newest
        `keep` such files (0: none is kept)."""
        if keep <= 0:
            return
        self.rollouts.mkdir(exist_ok=True)
        path = self.rollouts / f"step-{step:06d}.jsonl.gz"
        tmp = path.with_name(path.name + ".tmp")
        with gzip.open(tmp, "wt", encoding="utf-8") as f:
            for record in records:
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
        os.replace(tmp, path)
        for old in sorted(self.rollout_dumps())[:-keep]:
            old.unlink()

    def rollout_dumps(self) -> list[Path]:
        return sorted(self.rollouts.glob("step-*.jsonl.gz")) if self.rollouts.exists() else []

    def write_teacher(self, record: dict[str, Any]) -> None:
        self.teacher_path.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")

    def write_dtype(self, record: dict[str, Any]) -> dict[str, Any] | None:
        """Record what the run computes in (an eviback.dtype.DtypeChoice as a dict); returns the record of
        an earlier process of this run when it chose another dtype (a run resumed on another machine)."""
        earlier = None
        if self.dtype_path.exists():
            try:
                previous = json.loads(self.dtype_path.read_text(encoding="utf-8"))
            except json.JSONDecodeError:
                previous = {}
            if previous.get("dtype") not in (None, record.get("dtype")):
                earlier = previous
        self.dtype_path.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
        return earlier

    def truncate_logs(self, step: int) -> None:
        """Keep only the records of steps <= `step` (a torn last line from a kill is dropped too)."""
        for dump in self.rollout_dumps():
            if int(dump.name.split("-")[1].split(".")[0]) > step:
                dump.unlink()
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

    def size_mb(self) -> float:
        """Everything the run directory holds, in MB."""
        return round(size_on_disk(self.root) / 1024 ** 2, 2)

    def read_metrics(self) -> list[dict[str, Any]]:
        return read_records(self.metrics_path)

    def read_groups(self) -> list[dict[str, Any]]:
        return read_records(self.groups_path)


def read_records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _as_override(value: object) -> str:
    """`value` as `--set key=VALUE` parses it back (YAML flow style, without YAML's end-of-document mark)."""
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()
