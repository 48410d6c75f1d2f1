"""What a run measures about its own process and the machine under it, per step (Linux `/proc`; None
elsewhere): memory and file descriptors, which a long run must keep flat, and where the CPU went, which
says whether a slow step was the run's own work or a machine shared with something else.

The CPU figures of a step:

- `time/cpu`: this process's CPU seconds (user + system, every thread). Against `time/step` it is the run's
  parallelism (at most the cores it may use).
- `host/other_cpu_s`: CPU seconds the machine spent on anything but this process (other processes, the
  kernel's own work for them) over the step.
- `host/steal_share`: the share of the machine's CPU time a virtual machine's host took for other guests
  (`steal` in /proc/stat): time the run wanted and could not have, whatever it ran.

Two runs' step times compare only where both show little of the last two.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass


def peak_rss_gb() -> float:
    """Peak resident memory of this process so far, in GB (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1024 ** 2)


def process_gauges() -> dict[str, float | int | None]:
    """What a long run must keep flat: resident memory now (GB) and open file descriptors (None where /proc
    is missing)."""
    try:
        pages = int(open("/proc/self/statm").read().split()[1])  # noqa: SIM115 - a one-line read
        rss = pages * os.sysconf("SC_PAGE_SIZE") / 1024 ** 3
        fds = len(os.listdir("/proc/self/fd"))
    except (OSError, ValueError):
        return {"memory/rss_gb": None, "process/open_fds": None}
    return {"memory/rss_gb": round(rss, 3), "process/open_fds": fds}


@dataclass(frozen=True)
class CpuSnapshot:
    """CPU counters at one moment: this process's CPU seconds and the machine's /proc/stat totals."""

    process_s: float
    busy_s: float | None = None  # machine-wide: user + nice + system + irq + softirq, in seconds
    steal_s: float | None = None
    total_s: float | None = None  # every /proc/stat state, idle and steal included


def _host_seconds() -> tuple[float, float, float] | None:
    """(busy, steal, total) CPU seconds of the whole machine since boot, from /proc/stat's `cpu` line."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        ticks = [int(x) for x in fields[1:9]]  # user nice system idle iowait irq softirq steal (guest is in user)
        hz = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
    if fields[0] != "cpu" or len(ticks) < 8:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = ticks
    return (user + nice + system + irq + softirq) / hz, steal / hz, sum(ticks) / hz


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
    # /proc/stat counts in clock ticks and rusage in microseconds: a few ticks of rounding either way
    record["host/other_cpu_s"] = round(max(0.0, busy - own), 3)
    record["host/steal_share"] = round(steal / total, 4) if total > 0 else None
    return record
