"""A soak test of the teacher's judging machinery: many judge calls through the real SQLite reply cache
leave the number of open file descriptors, the cache's open connections and the memory flat."""

import os

from eviback.teacher.cache import SqliteCache
from eviback.teacher.judge import JudgeConfig, Teacher
from eviback.teacher.policy import load_policy
from eviback.teacher.probes import build_probes
from teacher_fakes import ScriptedClient

CONCURRENCY = 8


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_500_judge_calls_leave_descriptors_connections_and_memory_flat(tmp_path):
    trajectories = [p.trajectory for p in build_probes(CONCURRENCY, seed=4)]
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
        assert f <= fds + 2, f"open file descriptors grew from {fds} to {f} by {call}: {samples}"
        assert c <= CONCURRENCY + 2, f"{c} open cache connections at {call}: {samples}"
        assert r <= rss + 64, f"RSS grew from {rss:.0f} MB to {r:.0f} MB by {call}: {samples}"
    assert len(cache) == 2 * 11 * CONCURRENCY  # two stages x 11 teacher samples x 8 rollouts
    cache.close()
    assert cache.open_connections == 0
