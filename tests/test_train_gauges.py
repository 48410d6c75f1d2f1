"""The per-step gauges of a training run: where the CPU went, so that a slow step can be told apart from a
busy machine (train/gauges.py)."""

import time

from eviback.train.gauges import CpuSnapshot, cpu_gauges, cpu_snapshot


def test_a_step_on_a_shared_machine_shows_the_others_cpu_and_the_steal():
    before = CpuSnapshot(process_s=10.0, busy_s=1000.0, steal_s=50.0, total_s=4000.0)
    # 60 s of a 2-core machine: 120 CPU seconds, of which the run used 70, others 30 and the host stole 12
    after = CpuSnapshot(process_s=80.0, busy_s=1100.0, steal_s=62.0, total_s=4120.0)
    assert cpu_gauges(before, after) == {"time/cpu": 70.0, "host/other_cpu_s": 30.0, "host/steal_share": 0.1}


def test_without_the_machines_counters_only_the_process_is_measured():
    assert cpu_gauges(CpuSnapshot(1.0), CpuSnapshot(3.5)) == {"time/cpu": 2.5, "host/other_cpu_s": None,
                                                              "host/steal_share": None}


def test_the_snapshot_counts_this_process_work():
    """The process's CPU seconds between two snapshots are at least the work done between them (a busy loop
    of 0.3 CPU seconds) and at most what the process's own clock read around them. Other threads of this
    process count in both, so the bounds hold however busy the machine or the process is."""
    outer_start = time.process_time()
    before = cpu_snapshot()
    deadline = time.process_time() + 0.3
    while time.process_time() < deadline:
        pass
    after = cpu_snapshot()
    outer = time.process_time() - outer_start
    gauges = cpu_gauges(before, after)
    slack = 0.01  # the two clocks' granularity, and the gauge's rounding to 1 ms
    assert 0.3 - slack <= gauges["time/cpu"] <= outer + slack
    assert gauges["host/other_cpu_s"] is None or gauges["host/other_cpu_s"] >= 0
    assert gauges["host/steal_share"] is None or 0 <= gauges["host/steal_share"] <= 1


def test_the_process_gauges_count_this_process_memory_and_open_files(tmp_path):
    from eviback.train.gauges import process_gauges

    before = process_gauges()
    with open(tmp_path / "f", "w"):
        during = process_gauges()
    assert before["memory/rss_gb"] > 0.01
    assert during["process/open_fds"] == before["process/open_fds"] + 1
