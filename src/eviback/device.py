"""Where models compute: the `device` setting, resolved once with the dtype into a :class:`Placement`.

Every model eviback loads (the policy engine, the trainer and its reference, the evidence judge, the local
teacher, the warm start, evaluation, the dense encoder, the APE controller) is put where one placement says,
and the inputs it is given follow the model (`placement.torch_device`, or `model.device`).

`device` takes:

- `auto` (every default): the local CUDA device when there is one, else the CPU. Under `torchrun` or
  `accelerate launch` "local" means this process's own GPU (`LOCAL_RANK`), so each process uses its own.
- `cpu`, `cuda` (the local CUDA device, as `auto` picks it), or `cuda:N` (that GPU).

`$EVIBACK_DEVICE` forces what `auto` resolves to, in this process and its children (as `$EVIBACK_DTYPE`
does for the dtype). The dtype is decided for the device it runs on (`eviback.dtype`: bf16 on a CUDA GPU
that has it), so the two are resolved together:

    from eviback.device import place
    p = place("auto", "auto")     # Placement(device='cuda:0', dtype='bfloat16', ...) on a GPU machine
    model.to(p.torch_device, p.torch_dtype)

Which models went where is recorded in this process (:func:`record`, :func:`placements`), and runs write
it beside their outputs, so a model left on the CPU by mistake is seen, not guessed.

torch is imported by the functions that ask it about the machine or make its objects: every configuration
checks a `device` setting here, and a command that loads no model should not load torch.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from eviback import dtype as dtypes

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

AUTO = "auto"
ENV_VAR = "EVIBACK_DEVICE"  # forces what `auto` resolves to, in this process and its children
_PATTERN = re.compile(r"^(auto|cpu|cuda|cuda:\d+)$")
HELP = ("where models compute: auto (the local CUDA GPU when there is one, else the CPU; under accelerate "
        "launch each process's own GPU), cpu, cuda or cuda:N")


def check_device(device: str, what: str = "device") -> str:
    """`device` if it is a known setting, else a ValueError naming the choices."""
    if not isinstance(device, str) or not _PATTERN.match(device):
        raise ValueError(f"{what} must be auto, cpu, cuda or cuda:N, got {device!r}")
    return device


def local_rank() -> int:
    """This process's index on its machine under torchrun / accelerate launch (0 in a single process)."""
    for name in ("LOCAL_RANK", "ACCELERATE_LOCAL_PROCESS_INDEX"):
        value = os.environ.get(name, "").strip()
        if value.isdigit():
            return int(value)
    return 0


def resolve_device(device: str = AUTO, *, cuda_available: bool | None = None, cuda_count: int | None = None,
                   rank: int | None = None) -> tuple[str, str]:
    """(device, reason): `cpu` or `cuda:N` for a `device` setting. Pure given its keyword arguments (the
    tests pass them; by default they are read from torch and the environment)."""
    check_device(device)
    if device == AUTO:
        forced = os.environ.get(ENV_VAR, "").strip()
        if forced:
            check_device(forced, what=f"${ENV_VAR}")
            if forced != AUTO:
                resolved, why = resolve_device(forced, cuda_available=cuda_available, cuda_count=cuda_count,
                                               rank=rank)
                return resolved, f"${ENV_VAR}={forced}: {why}"
    if cuda_available is None or cuda_count is None:
        import torch

        cuda_available = torch.cuda.is_available() if cuda_available is None else cuda_available
        cuda_count = (torch.cuda.device_count() if cuda_available else 0) if cuda_count is None else cuda_count
    rank = local_rank() if rank is None else rank
    if device == "cpu":
        return "cpu", "set explicitly"
    if device == AUTO and not cuda_available:
        return "cpu", "no CUDA device"
    if not cuda_available:
        raise ValueError(f"device={device} but no CUDA device is available here (torch sees none); use device=cpu "
                         "or auto")
    if device in (AUTO, "cuda"):
        index = rank if cuda_count > 1 else 0
        if index >= cuda_count:
            raise ValueError(f"this is local process {rank}, but only {cuda_count} CUDA device(s) are visible")
        why = "the local CUDA device" + (f" of local process {rank}" if cuda_count > 1 else "")
        return f"cuda:{index}", why if device == "cuda" else f"auto: {why}"
    index = int(device.split(":")[1])
    if index >= cuda_count:
        raise ValueError(f"device={device} but only {cuda_count} CUDA device(s) are visible (cuda:0..cuda:{cuda_count - 1})")
    return device, "set explicitly"


@dataclass(frozen=True)
class Placement:
    """Where and in what a model computes: a resolved device (`cpu`, `cuda:N`) and its dtype choice."""

    device: str
    dtype_choice: dtypes.DtypeChoice
    requested: str = AUTO  # the device setting as given
    reason: str = ""  # why this device

    @property
    def dtype(self) -> str:
        """bfloat16, float32 or float16."""
        return self.dtype_choice.dtype

    @property
    def kind(self) -> str:
        """`cpu` or `cuda` (what the dtype rule and torch's autocast key on)."""
        return self.device.split(":")[0]

    @property
    def accelerator(self) -> bool:
        """Whether the device is a GPU (anything but the CPU)."""
        return self.kind != "cpu"

    @property
    def torch_device(self) -> torch.device:
        import torch

        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)

    def with_dtype(self, requested: str) -> Placement:
        """The same device with another dtype setting (e.g. a classifier that always runs in float32)."""
        return Placement(self.device, dtypes.choose(requested, self.kind), self.requested, self.reason)

    def to_dict(self) -> dict[str, Any]:
        return {"device": self.device, "device_requested": self.requested, "device_reason": self.reason,
                **self.dtype_choice.to_dict(), "dtype_device": self.kind}


_logged: set[str] = set()
_lock = threading.Lock()


def place(device: str | Placement = AUTO, dtype: str = dtypes.AUTO) -> Placement:
    """The placement of a `device` and a `dtype` setting on this machine (a Placement is passed through).

    Logged once per process and device."""
    if isinstance(device, Placement):
        return device if dtype == dtypes.AUTO or dtype == device.dtype else device.with_dtype(dtype)
    resolved, reason = resolve_device(device)
    choice = dtypes.choose(dtype, resolved.split(":")[0])
    placement = Placement(resolved, choice, device, reason)
    with _lock:
        if resolved not in _logged:
            _logged.add(resolved)
            log.info("device %s -> %s (%s)", device, resolved, reason)
    if placement.accelerator:
        import torch

        torch.cuda.set_device(placement.torch_device)  # "cuda" without an index now means this one
    return placement


def pin_trainer(args: Any, placement: Placement) -> None:
    """Make a transformers trainer of one process compute on the placement's GPU.

    In one process (no torchrun / accelerate launch) `TrainingArguments` takes cuda:0 whatever
    `torch.cuda.set_device` said, and every visible GPU (it wraps the model in `nn.DataParallel` when it sees
    more than one); the placement is one GPU. Its device and GPU count are pinned to the placement, and the
    current CUDA device put back to the placement's (the accelerator the trainer builds computes on the
    current one). A launched run (several processes) is left as the launcher set it up."""
    if not placement.accelerator or args.world_size > 1:
        return
    import torch

    args.__dict__["_setup_devices"] = placement.torch_device  # the cached value of `args.device`
    args._n_gpu = 1
    torch.cuda.set_device(placement.torch_device)


# --------------------------------------------------------------------------------------------------
# What went where, in this process

_placed: list[dict[str, Any]] = []


def model_device(model: Any) -> str:
    """The device of a module's first parameter (`cpu`, `cuda:0`; `none` for a module without any)."""
    try:
        parameter = next(iter(model.parameters()))
    except (StopIteration, AttributeError, TypeError):
        return "none"
    return str(parameter.device)


def record(what: str, model: Any, placement: Placement | None = None) -> Any:
    """Note that `what` (e.g. "policy engine") was loaded onto the device its parameters are on, and
    return the model. A model away from the placement it was meant for is logged as a warning."""
    where = model_device(model)
    meant = placement.device if placement is not None else None
    with _lock:
        _placed.append({"what": what, "device": where, "placement": meant})
    if meant is not None and where not in ("none", meant):
        log.warning("%s is on %s, not on %s as its placement says", what, where, meant)
    else:
        log.debug("%s on %s", what, where)
    return model


def placements() -> list[dict[str, Any]]:
    """Every model :func:`record` saw in this process, in order: {"what", "device", "placement"}."""
    with _lock:
        return [dict(p) for p in _placed]


def off_device(records: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """The recorded models that are not where their placement meant them to be."""
    return [r for r in (placements() if records is None else records)
            if r["placement"] is not None and r["device"] not in ("none", r["placement"])]


def reset() -> None:
    """Forget the records and the logged devices (tests)."""
    with _lock:
        _placed.clear()
        _logged.clear()


def memory(device: str) -> tuple[int, int]:
    """(free, total) bytes of a CUDA `device` (`cuda:N`) as this process can use them: what the driver reports
    free plus what torch's caching allocator holds unused (its reserved blocks are free to this process).
    Raises ValueError for the CPU, whose memory no engine plans against."""
    import torch

    if not device.startswith("cuda"):
        raise ValueError(f"memory() is for CUDA devices, got {device!r}")
    free, total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(free + cached), int(total)
