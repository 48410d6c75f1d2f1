"""The compute dtype, and what `dtype: auto` (every model's default) means on this machine.

bf16 halves memory traffic and, where the hardware multiplies bf16 natively (a CUDA GPU with bf16
support, a CPU with AVX512-BF16 or AMX), runs matmuls about twice as fast as fp32. Where it does not, the
library emulates it: on an AVX2-only CPU a bf16 matmul ran about 60x *slower* than fp32 (1.25 against 76
GFLOP/s, one thread), so a bf16 default that is right on one machine makes everything crawl on another.

`auto` is therefore decided by what this machine does, measured rather than guessed from CPU flags:
flags do not tell which kernels PyTorch and oneDNN will dispatch to (`ATEN_CPU_CAPABILITY` and
`ONEDNN_MAX_CPU_ISA` can restrict them, and a CPU with AVX-512 but no BF16 gets an emulated path of its own).

- CUDA: bf16 when `torch.cuda.is_bf16_supported()`, else fp32.
- CPU: a short one-thread micro-benchmark of a bf16 and an fp32 matmul (under a second even on the slow
  path; cached on disk per CPU model, torch version and ISA settings, so a process reads it in
  microseconds). bf16 when it is at least `BF16_MIN_SPEEDUP` times as fast as fp32, fp32 otherwise: bf16
  loses precision, so it has to buy speed to be chosen (native bf16 measured 2.4x; emulated 0.02x).

Force a dtype with the setting itself (`dtype: float32`, `--dtype bfloat16`), or for every model of a
process and its children with `EVIBACK_DTYPE=float32`. The choice and its reason are logged once per
process (:func:`choose`), and runs write them beside their outputs (:meth:`DtypeChoice.to_dict`).

    from eviback.dtype import choose, resolve
    resolve("auto")     # 'bfloat16' or 'float32'
    choose("auto").reason

torch is imported inside the functions that measure or name a dtype: every command reads this module, and
one that never loads a model should not pay torch's start-up (seconds).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eviback.cache import cache_dir

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

AUTO = "auto"
# What a model can be loaded in to generate or judge: float16 too (a GPU without bf16 serves in it).
DTYPES = ("bfloat16", "float32", "float16")
# What a model trains in: float16 training needs loss scaling, which none of eviback's trainers does (and a
# CPU has no float16 kernels worth using), so it is refused where a model is trained.
TRAINING_DTYPES = ("bfloat16", "float32")
# The `--dtype` choices of the commands: those that run a model, those that train one.
CHOICES = (AUTO, *DTYPES)
TRAINING_CHOICES = (AUTO, *TRAINING_DTYPES)
ENV_VAR = "EVIBACK_DTYPE"  # forces what `auto` resolves to, in this process and its children
# bf16 must be at least this much faster than fp32 to be chosen (native: ~2.4x; emulated: ~0.02x).
BF16_MIN_SPEEDUP = 1.3
# Environment variables that change which CPU kernels run, hence the measurement's cache key.
ISA_VARIABLES = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
MEASURE_VERSION = 1  # bump when the micro-benchmark changes: older cached measurements are not reused


@dataclass(frozen=True)
class MatmulSpeed:
    """A one-thread square-matmul measurement: GFLOP/s in bf16 and in fp32 (n x n times n x n)."""

    bf16_gflops: float
    fp32_gflops: float
    size: int
    threads: int = 1

    @property
    def bf16_speedup(self) -> float:
        return self.bf16_gflops / self.fp32_gflops if self.fp32_gflops > 0 else 0.0


@dataclass(frozen=True)
class DtypeChoice:
    """What a `dtype` setting resolved to on this machine, and why."""

    requested: str  # the setting as given: auto, bfloat16, float32, float16
    dtype: str  # what runs: bfloat16, float32 or float16
    reason: str  # one sentence, for logs and run records
    device: str  # cpu or cuda
    speed: MatmulSpeed | None = None  # the CPU measurement `auto` was decided by (None: not measured)
    cpu_capability: str | None = None  # torch.backends.cpu.get_cpu_capability()
    cpu_bf16_flags: tuple[str, ...] = ()  # avx512_bf16 / amx_bf16 flags the CPU reports (informational)

    def to_dict(self) -> dict[str, Any]:
        record = asdict(self)
        record["cpu_bf16_flags"] = list(self.cpu_bf16_flags)
        if self.speed is not None:
            record["speed"]["bf16_speedup"] = round(self.speed.bf16_speedup, 4)
        return record


def check(dtype: str, *, allow_auto: bool = True, allowed: tuple[str, ...] = DTYPES, what: str = "dtype") -> str:
    """`dtype` if it is a known setting, else a ValueError naming the choices."""
    names = (AUTO, *allowed) if allow_auto else allowed
    if dtype not in names:
        raise ValueError(f"{what} must be one of {', '.join(names)}, got {dtype!r}")
    return dtype


def decide(*, cuda: bool, cuda_bf16: bool = False, speed: MatmulSpeed | None = None,
           min_speedup: float = BF16_MIN_SPEEDUP) -> tuple[str, str]:
    """(dtype, reason) for `auto` from what the device does: pure, so the rule is tested on its own."""
    if cuda:
        if cuda_bf16:
            return "bfloat16", "CUDA device with native bf16"
        return "float32", "CUDA device without bf16 support"
    if speed is None:
        raise ValueError("a CPU decision needs the matmul measurement")
    ratio = speed.bf16_speedup
    figures = (f"bf16 matmul {speed.bf16_gflops:.1f} GFLOP/s vs fp32 {speed.fp32_gflops:.1f} GFLOP/s "
               f"(one thread, {speed.size}^3): bf16 {ratio:.2f}x fp32")
    if ratio >= min_speedup:
        return "bfloat16", f"CPU with native bf16: {figures}"
    return "float32", f"CPU without native bf16: {figures}, below the {min_speedup:g}x bf16 needs to be chosen"


def measure_matmul(size: int = 384, seconds: float = 0.15) -> MatmulSpeed:
    """One-thread GFLOP/s of an (size x size) @ (size x size) matmul in bf16 and in fp32.

    Each dtype gets one warm-up product and then as many as fit in `seconds` (at least two). One thread,
    so the figure does not depend on what else is running on the other cores as much, and because the
    ratio, not the peak, is what is decided on."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        results = {}
        generator = torch.Generator().manual_seed(0)
        for dt in (torch.float32, torch.bfloat16):
            a = torch.randn(size, size, generator=generator).to(dt)
            b = torch.randn(size, size, generator=generator).to(dt)
            torch.mm(a, b)  # warm-up: the kernel choice and its buffers
            count, start = 0, time.perf_counter()
            while count < 2 or time.perf_counter() - start < seconds:
                torch.mm(a, b)
                count += 1
            elapsed = time.perf_counter() - start
            results[dt] = 2 * size ** 3 * count / elapsed / 1e9
    finally:
        torch.set_num_threads(before)
    return MatmulSpeed(bf16_gflops=round(results[torch.bfloat16], 2), fp32_gflops=round(results[torch.float32], 2),
                       size=size)


def cpu_bf16_flags() -> tuple[str, ...]:
    """The bf16-related flags /proc/cpuinfo lists (empty where it does not exist)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            return tuple(f for f in ("avx512_bf16", "amx_bf16", "amx_tile") if f in flags)
    return ()


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _measurement_key() -> str:
    """What the measurement depends on: the CPU, torch, and the ISA settings that pick its kernels."""
    import torch

    parts = {"v": MEASURE_VERSION, "cpu": _cpu_model(), "flags": cpu_bf16_flags(), "torch": torch.__version__,
             "capability": torch.backends.cpu.get_cpu_capability(),
             **{name: os.environ.get(name, "") for name in ISA_VARIABLES}}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def cpu_speed(*, use_cache: bool = True) -> MatmulSpeed:
    """This CPU's bf16 and fp32 matmul speed, measured once and cached (`$EVIBACK_CACHE/dtype/`)."""
    path = cache_dir() / "dtype" / f"matmul-{_measurement_key()}.json"
    if use_cache:
        try:
            return MatmulSpeed(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            pass  # not measured yet (or an unreadable file): measure again
    speed = measure_matmul()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(asdict(speed)) + "\n")
        os.replace(tmp, path)
    except OSError as e:  # a read-only cache: the choice still stands, it is only measured again next time
        log.debug("could not cache the matmul measurement in %s: %s", path, e)
    return speed


_lock = threading.Lock()
_auto: dict[str, DtypeChoice] = {}  # per device, for this process
_logged: set[tuple[str, str]] = set()


def _auto_choice(device: str) -> DtypeChoice:
    import torch

    forced = os.environ.get(ENV_VAR, "").strip()
    if forced:
        check(forced, allow_auto=False, what=f"${ENV_VAR}")
        return DtypeChoice(AUTO, forced, f"${ENV_VAR}={forced}", device)
    capability = torch.backends.cpu.get_cpu_capability()
    if device == "cuda":
        dtype, reason = decide(cuda=True, cuda_bf16=torch.cuda.is_bf16_supported())
        return DtypeChoice(AUTO, dtype, reason, device)
    speed = cpu_speed()
    dtype, reason = decide(cuda=False, speed=speed)
    return DtypeChoice(AUTO, dtype, reason, device, speed, capability, cpu_bf16_flags())


def choose(requested: str = AUTO, device: str | None = None) -> DtypeChoice:
    """What `requested` (auto or a dtype name) runs as on `device` (default: cuda when available, else cpu).

    `auto` is decided once per process and device (see the module docstring) and logged the first time;
    an explicit dtype is taken as given."""
    check(requested)
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if requested != AUTO:
        return DtypeChoice(requested, requested, "set explicitly", device)
    with _lock:
        choice = _auto.get(device)
        if choice is None:
            choice = _auto[device] = _auto_choice(device)
        key = (device, choice.dtype)
        if key not in _logged:
            _logged.add(key)
            log.info("dtype auto -> %s on %s: %s (force one with dtype=bfloat16|float32 or $%s)",
                     choice.dtype, device, choice.reason, ENV_VAR)
    return choice


def resolve(requested: str = AUTO, device: str | None = None) -> str:
    """The dtype name `requested` runs as: `choose(requested, device).dtype`."""
    return choose(requested, device).dtype


def torch_dtype(requested: str = AUTO, device: str | None = None) -> torch.dtype:
    """The torch dtype `requested` runs as."""
    import torch

    return getattr(torch, resolve(requested, device))


def reset() -> None:
    """Forget this process's `auto` decisions (tests; after changing $EVIBACK_DTYPE)."""
    with _lock:
        _auto.clear()
        _logged.clear()
