"""A soak test of the teacher's judging machinery: many judge calls through the real SQLite reply cache
leave the number of open file descriptors, the cache's open connections and the memory flat.

The calls run in a fresh Python process: inside the test session other tests' threads (an engine, HTTP
servers) open and close descriptors and allocate memory at any time, which would make the counts noisy."""

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil

from eviback.teacher.cache import SqliteCache
from eviback.teacher.judge import JudgeConfig, Teacher
from eviback.teacher.policy import load_policy
from eviback.teacher.probes import build_probes
from teacher_fakes import ScriptedClient

CONCURRENCY = 8


def open_fds() -> int:
    return psutil.Process().num_fds()


def rss_mb() -> float:
    return psutil.Process().memory_info().rss / 2**20


def soak(tmp_path: Path) -> None:
    trajectories = [p.trajectory for p in build_probes(CONCURRENCY, seed=4)]
    before_cache = open_fds()
    cache = SqliteCache(tmp_path / "replies.sqlite")
    client = ScriptedClient()
    policy = load_policy("two-stage")
    samples = {}
    with Teacher(policy, client, JudgeConfig(concurrency=CONCURRENCY), cache=cache) as teacher:
        for call in range(1, 501):
            # a new teacher sample every 50 calls: the cache is written as well as read
            verdicts = teacher.judge(trajectories, sample_index=call // 50)
            assert len(verdicts) == CONCURRENCY and not any(v.teacher_error for v in verdicts)
            if call in (50, 250, 500):
                samples[call] = (open_fds(), cache.open_connections, rss_mb())
    # teachers that come and go over one shared cache (as E2E-APE's candidates do)
    for _ in range(50):
        with Teacher(policy, client, JudgeConfig(concurrency=CONCURRENCY), cache=cache) as short_lived:
            short_lived.judge(trajectories)
    samples["short-lived"] = (open_fds(), cache.open_connections, rss_mb())
    fds, connections, rss = samples[50]
    for call, (f, c, r) in samples.items():
        # each open SQLite connection holds one to three files (database, WAL, shared memory), opened lazily
        # by whichever thread happens to read or write: the count moves within that bound, a leak does not
        assert f <= fds + 2 * (CONCURRENCY + 1), f"open file descriptors grew from {fds} to {f} by {call}: {samples}"
        assert c <= CONCURRENCY + 2, f"{c} open cache connections at {call}: {samples}"
        assert r <= rss + 64, f"RSS grew from {rss:.0f} MB to {r:.0f} MB by {call}: {samples}"
    assert len(cache) == 2 * 11 * CONCURRENCY  # two stages x 11 teacher samples x 8 rollouts
    cache.close()
    assert cache.open_connections == 0
    # closing the cache gives every descriptor of its connections back
    assert open_fds() <= before_cache + 2, f"{open_fds()} descriptors open after close, {before_cache} before"
    print(json.dumps({str(k): v for k, v in samples.items()}))


def test_500_judge_calls_leave_descriptors_connections_and_memory_flat(tmp_path):
    here = Path(__file__).parent
    code = f"import test_teacher_soak as t, pathlib; t.soak(pathlib.Path({str(tmp_path)!r}))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], cwd=here, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
