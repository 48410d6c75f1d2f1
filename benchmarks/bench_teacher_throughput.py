"""Judging throughput against a real local OpenAI-compatible server: concurrency 1 vs N, and the warm cache.

    python benchmarks/bench_teacher_throughput.py --backend vllm [--rollouts 16] [--server-log FILE]
    python benchmarks/bench_teacher_throughput.py --backend http --base-url URL [--model NAME]

The two-stage policy judges real-data probe rollouts (build_probes). To keep the comparison fair on a busy
machine, runs alternate in one process (c=1, c=N, c=1, c=N), each on its own disjoint set of rollouts (so
that no run replays another's prompts from the server's prefix cache), without the reply cache. Then one
more set is judged twice with a fresh SQLite reply cache: cold (every call paid) and warm (every call a
cache hit). Reported: rollouts/s, stage calls, tokens, and the speed-ups.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from teacher_backends import add_backend_arguments, open_backend

from eviback.teacher.cache import SqliteCache
from eviback.teacher.judge import JudgeConfig, Teacher
from eviback.teacher.policy import load_policy
from eviback.teacher.probes import build_probes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_backend_arguments(parser, default="vllm")
    parser.add_argument("--rollouts", type=int, default=16, help="rollouts per run")
    parser.add_argument("--concurrency", type=int, default=8, help="N, compared with 1")
    parser.add_argument("--policy", default="two-stage")
    parser.add_argument("--seed", type=int, default=33,
                        help="probe seed; change it to avoid prompts a running server has already seen")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)

    n = args.rollouts
    probes = [p.trajectory for p in build_probes(5 * n, seed=args.seed)]
    sets = [probes[i * n:(i + 1) * n] for i in range(5)]
    policy = load_policy(args.policy)
    runs = []

    def run(client, rollouts, concurrency, label, cache=None):
        # not closed here: the client and the cache are shared across runs
        teacher = Teacher(policy, client, JudgeConfig(concurrency=concurrency), cache=cache)
        start = time.perf_counter()
        verdicts = teacher.judge(rollouts)
        wall = time.perf_counter() - start
        t = teacher.stats().total
        row = {"run": label, "concurrency": concurrency, "rollouts": len(rollouts), "wall_s": round(wall, 2),
               "rollouts_per_s": round(len(rollouts) / wall, 3), "requests": t.requests, "calls": t.calls,
               "cache_hits": t.cache_hits, "errors": sum(v.teacher_error for v in verdicts),
               "load_avg_1min": round(os.getloadavg()[0], 2),  # the machine may be shared: say how busy
               "prompt_tokens": t.prompt_tokens, "completion_tokens": t.completion_tokens}
        runs.append(row)
        print(json.dumps(row), flush=True)
        return row

    with open_backend(args, max_connections=max(args.concurrency, 8)) as client:
        run(client, probes[:4], 4, "warm-up")  # first requests pay one-off compilation on the server
        for i, c in enumerate((1, args.concurrency, 1, args.concurrency)):
            run(client, sets[i], c, f"set{i}")
        with tempfile.TemporaryDirectory() as tmp:
            cache = SqliteCache(Path(tmp) / "replies.sqlite")
            cold = run(client, sets[4], args.concurrency, "cold-cache", cache)
            warm = run(client, sets[4], args.concurrency, "warm-cache", cache)
            cache.close()
        backend = client.backend_id

    def mean_rate(c):
        rows = [r for r in runs if r["run"].startswith("set") and r["concurrency"] == c]
        return sum(r["rollouts"] for r in rows) / sum(r["wall_s"] for r in rows)

    one, many = mean_rate(1), mean_rate(args.concurrency)
    summary = {"backend": backend, "policy": policy.name, "rollouts_per_s_c1": round(one, 3),
               f"rollouts_per_s_c{args.concurrency}": round(many, 3), "speedup_concurrency": round(many / one, 2),
               "cold_rollouts_per_s": cold["rollouts_per_s"], "warm_rollouts_per_s": warm["rollouts_per_s"],
               "speedup_warm_cache": round(warm["rollouts_per_s"] / cold["rollouts_per_s"], 1)}
    print(json.dumps(summary, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"config": {k: str(v) for k, v in vars(args).items()}, "runs": runs,
                                        "summary": summary}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
