"""Disk space for what a run writes: the size of a training checkpoint, a check before the first step, and
telling a full disk from other failures.

A checkpoint of a policy is several times its weights: the model in its dtype, the fp32 master weights of a
bf16 run, and AdamW's two moments for every optimised parameter (1.9 GB for the 135M policy in bf16 with
masters). transformers writes a checkpoint before it rotates out the oldest, so `save_total_limit` checkpoints
are on disk plus the one being written. A disk that fills in the middle of a save is reported as what it is
(`eviback train` exits 75, `eviback.unavailable.RESUMABLE_EXIT`, and says how to continue), not as the
library's I/O traceback.
"""

from __future__ import annotations

import errno
import math
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eviback.unavailable import error_chain

# What a full disk (or a full quota) looks like when it is not an OSError: safetensors' Rust writer raises
# `SafetensorError: ... I/O error: No space left on device (os error 28)`, torch.save a RuntimeError.
FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
FULL_WORDS = ("no space left on device", "os error 28", "disk quota exceeded", "os error 122")


def full_disk_error(error: BaseException) -> BaseException | None:
    """The error in `error`'s chain (itself, or what it was raised from or during) that says the disk or the
    quota is full; None when none does."""
    for current in error_chain(error):
        if isinstance(current, OSError) and current.errno in FULL_ERRNOS:
            return current
        if any(words in str(current).lower() for words in FULL_WORDS):
            return current
    return None


def free_bytes(path: str | Path) -> int:
    """Free bytes on the file system that holds `path` (its nearest existing parent if it does not exist yet)."""
    return shutil.disk_usage(_existing(path)).free


def _existing(path: str | Path) -> Path:
    place = Path(path).absolute()
    while not place.exists() and place != place.parent:
        place = place.parent
    return place


def free_space(places: dict[str, str | Path]) -> str:
    """The free space of the file systems holding `places` (name -> path), each file system once: "77 GB
    are free under the run directory" or "... under the run directory, 3 GB under the cache (PATH)"."""
    by_device: dict[int, tuple[str, Path]] = {}
    for name, path in places.items():
        by_device.setdefault(_existing(path).stat().st_dev, (name, Path(path)))
    parts = [f"{gigabytes(free_bytes(path))} under {name}" + ("" if i == 0 else f" ({path})")
             for i, (name, path) in enumerate(by_device.values())]
    return "free now: " + ", ".join(parts)


def gigabytes(n: int | float) -> str:
    """`n` bytes for a person: GB, MB below 0.1 GB, kB below 1 MB."""
    if n >= 1e8:
        return f"{n / 1e9:.1f} GB"
    return f"{n / 1e6:.0f} MB" if n >= 1e6 else f"{n / 1e3:.0f} kB"


def size_on_disk(path: str | Path) -> int:
    """Bytes of the file `path`, or of the files under it (0 when it does not exist)."""
    root = Path(path)
    if root.is_file():
        return root.stat().st_size
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file()) if root.exists() else 0


def checkpoint_parameters(model_dir: str | Path) -> int:
    """The number of parameters a Hugging Face checkpoint holds, from its safetensors headers (shapes only:
    nothing is loaded); each tensor counted once, as the model's tied weights are stored once."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir} holds no .safetensors weights to size the run's checkpoints from")
    total = 0
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (a safetensors file is not iterable)
                total += math.prod(f.get_slice(name).get_shape())
    return total


def tensor_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of `tensors` (anything with numel and element_size), each storage counted once."""
    return sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values())


@dataclass(frozen=True)
class RunFootprint:
    """What a training run writes, in bytes: one checkpoint, the final model, and how many checkpoints it
    writes and keeps."""

    checkpoint: int
    final: int
    checkpoints_to_write: int
    save_total_limit: int

    @classmethod
    def of(cls, model: Any, master: Any | None, optimizer: Any, *, steps_left: int, save_steps: int,
           save_total_limit: int) -> RunFootprint:
        """The footprint of a run training `model` (with fp32 `master` weights, or None) with AdamW
        `optimizer` for `steps_left` more steps, checkpointing every `save_steps` (0: never) and at the last."""
        weights = tensor_bytes(model.parameters()) + (tensor_bytes(master.parameters()) if master is not None else 0)
        optimised = tensor_bytes(p for group in optimizer.param_groups for p in group["params"])
        final = tensor_bytes((master if master is not None else model).parameters())
        to_write = math.ceil(steps_left / save_steps) if save_steps and steps_left > 0 else 0
        return cls(weights + 2 * optimised, final, to_write, save_total_limit)

    @classmethod
    def planned(cls, parameters: int, *, masters: bool, steps_left: int, save_steps: int,
                save_total_limit: int) -> RunFootprint:
        """The footprint of a run training a policy of `parameters` parameters, before anything is loaded: a bf16
        model with fp32 masters (`masters`: 2 + 4 bytes a parameter, AdamW's moments 8 on the masters) or an fp32
        model (4, moments 8); the final model in fp32. :meth:`of` counts the same from the tensors."""
        weights = (2 + 4) * parameters if masters else 4 * parameters
        to_write = math.ceil(steps_left / save_steps) if save_steps and steps_left > 0 else 0
        return cls(weights + 8 * parameters, 4 * parameters, to_write, save_total_limit)

    @property
    def first_write(self) -> int:
        """Bytes the run must be able to write before it has anything to resume from: its first checkpoint,
        or its final model when it writes none."""
        return self.checkpoint if self.checkpoints_to_write else self.final

    @property
    def peak(self) -> int:
        """Bytes the run adds at most: the checkpoints on disk at once (the kept ones and the one being
        written) and the final model."""
        return min(self.checkpoints_to_write, self.save_total_limit + 1) * self.checkpoint + self.final

    def check(self, path: str | Path, free: int | None = None, *, retry: str = "Free space there") -> str | None:
        """Refuse (ValueError, ending with `retry`: how to try again) a run whose disk cannot take its first
        write; return a warning when it cannot take the run's peak (another process may free space meanwhile);
        None when it fits."""
        free = free_bytes(path) if free is None else free
        room = (f"one checkpoint of this run takes {gigabytes(self.checkpoint)} (the weights, any fp32 masters "
                f"and AdamW's two moments), the final model {gigabytes(self.final)}")
        if free < self.first_write:
            what = "its first checkpoint" if self.checkpoints_to_write else "its final model"
            raise ValueError(f"the disk holding {path} has {gigabytes(free)} free, too little for {what}: {room}. "
                             f"{retry}")
        if free < self.peak:
            return (f"the disk holding {path} has {gigabytes(free)} free and this run may write "
                    f"{gigabytes(self.peak)} ({room}; save_total_limit={self.save_total_limit} keeps "
                    f"{self.save_total_limit} and writes the next before removing the oldest): it may fill "
                    f"before the run ends. `--set save_total_limit=1` keeps fewer; a full disk stops the run, "
                    f"and --resume continues it from its last complete checkpoint")
        return None
