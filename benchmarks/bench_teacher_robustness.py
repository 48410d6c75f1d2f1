"""Teacher robustness: judging through a server that hangs, returns HTTP 500, garbage or malformed replies.

    python benchmarks/bench_teacher_robustness.py [--rollouts 24] [--concurrency 8] [--out FILE.json]

A real OpenAI-compatible HTTP server on 127.0.0.1 (the test suite's FaultyChatServer, tests/teacher_fakes.py) answers every
chat call with one fault; the two-stage policy judges real-data probe rollouts through the HTTP client with
the judge's retries (3 attempts, 0.2 s backoff doubling) and a 1 s call timeout. For each fault it reports
whether the run finished, how many verdicts are teacher_error, the calls/retries made, and the wall time.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the faulty server is a test double

from eviback.teacher.judge import JudgeConfig, RetryConfig, Teacher
from eviback.teacher.openai_http import HttpBackendConfig, OpenAIChatClient
from eviback.teacher.policy import load_policy
from eviback.teacher.probes import build_probes
from teacher_fakes import Fault, FaultyChatServer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rollouts", type=int, default=24)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=1.0, help="per-call timeout (s)")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)

    rollouts = [p.trajectory for p in build_probes(args.rollouts, seed=0)]
    policy = load_policy("two-stage")
    retry = RetryConfig(max_attempts=3, backoff_s=0.2)
    rows = []
    for fault in (Fault.OK, Fault.HANG, Fault.ERROR_500, Fault.GARBAGE, Fault.MALFORMED, Fault.FLAKY,
                  Fault.NO_SCHEMA):
        with FaultyChatServer(fault, hang_s=60, fail_first=5) as server:
            client = OpenAIChatClient(HttpBackendConfig(base_url=server.base_url, model="faulty",
                                                        timeout_s=args.timeout))
            with Teacher(policy, client, JudgeConfig(concurrency=args.concurrency, retry=retry)) as teacher:
                start = time.perf_counter()
                verdicts = teacher.judge(rollouts)
                wall = time.perf_counter() - start
                stats = teacher.stats().total
            client.close()
        errors = [v for v in verdicts if v.teacher_error]
        rows.append({
            "fault": fault.value, "rollouts": len(verdicts), "finished": len(verdicts) == len(rollouts),
            "teacher_errors": len(errors), "scored_as_zero_by_mistake": sum(v.reward == 0.0 for v in errors),
            "calls": stats.calls, "retries": stats.retries, "schema_violations": stats.schema_violations,
            "wall_s": round(wall, 2), "example_error": errors[0].error if errors else "",
        })
        print(json.dumps(rows[-1]), flush=True)
    print()
    print("| server fault | finished | teacher_error | calls | retries | schema violations | wall (s) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['fault']} | {r['finished']} | {r['teacher_errors']}/{r['rollouts']} | {r['calls']} | "
              f"{r['retries']} | {r['schema_violations']} | {r['wall_s']} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"config": vars(args) | {"out": str(args.out)}, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
