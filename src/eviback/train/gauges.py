"""What a run measures about its own process and the machine under it, per step (through psutil; a figure
the platform does not report is None): memory and file descriptors, which a long run must keep flat, and where the CPU went, which
says whether a slow step was the run's own work or a machine shared with something else.

The CPU figures of a step:

- `time/cpu`: this process's CPU seconds (user + system, every thread). Against `time/step` it is the run's
  parallelism (at most the cores it may use).
- `host/other_cpu_s`: CPU seconds the machine spent on anything but this process (other processes, the
  kernel's own work for them) over the step.
- `host/steal_share`: the share of the machine's CPU time a virtual machine's host took for other guests
  (`steal` of the machine's CPU times, Linux): time the run wanted and could not have, whatever it ran.

Two runs' step times compare only where both show little of the last two.
"""

from __future__ import annotations

import resource
import sys
from dataclasses import dataclass

import psutil


def peak_rss_gb() -> float:
    """Peak resident memory of this process so far, in GB (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1024 ** 2)


def process_gauges() -> dict[str, float | int | None]:
    """What a long run must keep flat: resident memory now (GB) and open file descriptors (None where the
    platform does not report them)."""
    try:
        process = psutil.Process()
        rss = process.memory_info().rss / 1024 ** 3
        fds = process.num_fds()
    except (psutil.Error, AttributeError, OSError):  # num_fds exists on POSIX systems only
        return {"memory/rss_gb": None, "process/open_fds": None}
    return {"memory/rss_gb": round(rss, 3), "process/open_fds": fds}


@dataclass(frozen=True)
class CpuSnapshot:
    """CPU counters at one moment: this process's CPU seconds and the machine's CPU-time totals."""

    process_s: float
    busy_s: float | None = None  # machine-wide: user + nice + system + irq + softirq, in seconds
    steal_s: float | None = None
    total_s: float | None = None  # every state of the machine's CPU times, idle and steal included


def _host_seconds() -> tuple[float, float, float] | None:
    """(busy, steal, total) CPU seconds of the whole machine since boot (psutil's CPU times: Linux's
    /proc/stat `cpu` line in seconds); None where the platform does not report steal time."""
    try:
        times = psutil.cpu_times()
    except (psutil.Error, OSError):
        return None
    # user nice system idle iowait irq softirq steal (guest time is counted in user)
    states = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
    if not all(hasattr(times, name) for name in states):
        return None
    seconds = {name: getattr(times, name) for name in states}
    busy = sum(seconds[name] for name in ("user", "nice", "system", "irq", "softirq"))
    return busy, seconds["steal"], sum(seconds.values())


def cpu_snapshot() -> CpuSnapshot:
    """The counters now."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    host = _host_seconds()
    if host is None:
        return CpuSnapshot(usage.ru_utime + usage.ru_stime)
    busy, steal, total = host
    return CpuSnapshot(usage.ru_utime + usage.ru_stime, busy, steal, total)


def cpu_gauges(before: CpuSnapshot, after: CpuSnapshot) -> dict[str, float | None]:
    """The CPU figures of the interval between two snapshots (see the module's docstring)."""
    own = max(0.0, after.process_s - before.process_s)
    record: dict[str, float | None] = {"time/cpu": round(own, 3), "host/other_cpu_s": None,
                                       "host/steal_share": None}
    if None in (before.busy_s, after.busy_s, before.total_s, after.total_s, before.steal_s, after.steal_s):
        return record
    busy = after.busy_s - before.busy_s  # type: ignore[operator]
    total = after.total_s - before.total_s  # type: ignore[operator]
    steal = after.steal_s - before.steal_s  # type: ignore[operator]
    # the machine's CPU times count in clock ticks and rusage in microseconds: a few ticks of rounding either way
    record["host/other_cpu_s"] = round(max(0.0, busy - own), 3)
    record["host/steal_share"] = round(steal / total, 4) if total > 0 else None
    return record


def gpu_gauges(*, reset: bool = True) -> dict[str, float]:
    """This process's GPU memory on its current CUDA device, in GB: the peak allocated since the last reset
    (`gpu/peak_gb`: what a step needs) and what the allocator holds now (`gpu/reserved_gb`); the peak is
    reset for the next step when `reset`. Empty where no CUDA device is in use."""
    torch = sys.modules.get("torch")  # never the reason torch is imported
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {}
    gauges = {"gpu/peak_gb": round(torch.cuda.max_memory_allocated() / 1e9, 3),
              "gpu/reserved_gb": round(torch.cuda.memory_reserved() / 1e9, 3)}
    if reset:
        torch.cuda.reset_peak_memory_stats()
    return gauges
