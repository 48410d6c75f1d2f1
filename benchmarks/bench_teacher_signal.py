"""Does the teacher give all-zero groups a learning signal? Measured on real warm-started rollouts.

    python benchmarks/bench_teacher_signal.py --backend local --groups 50 \
        --rollouts results/teacher-signal/rollouts/train_groups.jsonl \
        --policies two-stage JUDGE_DIR/policy.json --out results/teacher-signal/signal.json

The rollouts are G per training question (bench_teacher_rollouts.py). The first `--groups` groups in which
no rollout has EM 1 (the groups EviBack hands to the teacher) are judged by each policy, whole workflow
(Stage A, then Stage B on S/A with its grounding). Reported per policy:

- the informative fallback share: groups whose teacher advantages are not all zero (eviback.backoff);
- Spearman's rho between a rollout's teacher reward and its evidence label's value (S 1, A 0.5, I 0);
- Stage B's ungrounded rate: verdicts lowered to I because the refined answer was not in the evidence seen
  (per judged rollout, and per Stage B run);
- the cost per judged rollout: teacher seconds (wall, concurrency as given), prompt and completion tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from teacher_backends import add_backend_arguments, open_backend  # noqa: E402

from eviback.backoff import BackoffConfig, group_advantages  # noqa: E402
from eviback.metrics import exact_match  # noqa: E402
from eviback.teacher.judge import JudgeConfig, Teacher, read_trajectories  # noqa: E402
from eviback.teacher.labels import LABEL_VALUE, trajectory_label  # noqa: E402
from eviback.teacher.policy import load_policy  # noqa: E402


def ranks(values: list[float]) -> list[float]:
    """Average ranks (ties share the mean of their positions), 1-based."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    at = 0
    while at < len(order):
        end = at
        while end + 1 < len(order) and values[order[end + 1]] == values[order[at]]:
            end += 1
        for k in range(at, end + 1):
            out[order[k]] = (at + end) / 2 + 1
        at = end + 1
    return out


def spearman(x: list[float], y: list[float]) -> float | None:
    """Spearman's rho (Pearson on average ranks); None when either side is constant."""
    rx, ry = ranks(x), ranks(y)
    n = len(x)
    if n < 2:
        return None
    mx, my = sum(rx) / n, sum(ry) / n
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    sxx = sum((a - mx) ** 2 for a in rx)
    syy = sum((b - my) ** 2 for b in ry)
    return None if sxx == 0 or syy == 0 else sxy / (sxx * syy) ** 0.5


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_backend_arguments(parser)
    parser.add_argument("--rollouts", required=True, help="train_groups.jsonl of bench_teacher_rollouts.py")
    parser.add_argument("--groups", type=int, default=50)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--policies", nargs="+", default=["two-stage"])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)

    from eviback.teacher.config import register_judge_beside

    by_question: dict[str, list] = {}
    for t in read_trajectories(args.rollouts):
        by_question.setdefault(t.question.id, []).append(t)
    groups = [sorted(g, key=lambda t: t.sample_index) for g in by_question.values()]
    all_zero = [g for g in groups if max(exact_match(t.answer, t.question.golden_answers) for t in g) < 1]
    chosen = all_zero[: args.groups]
    flat = [t for g in chosen for t in g]
    labels = [trajectory_label(t) for t in flat]
    report = {
        "command": "python benchmarks/bench_teacher_signal.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "groups_in_dump": len(groups), "all_zero_groups": len(all_zero), "groups_judged": len(chosen),
        "rollouts_judged": len(flat), "labels": dict(Counter(s.value for s in labels)),
        "groups_with_label_variation": sum(len({trajectory_label(t) for t in g}) > 1 for g in chosen),
        "policies": [],
    }
    backoff = BackoffConfig()
    with open_backend(args) as client:
        for ref in args.policies:
            register_judge_beside(ref)
            policy = load_policy(ref)
            teacher = Teacher(policy, client, JudgeConfig(concurrency=args.concurrency))
            start = time.perf_counter()
            verdicts = teacher.judge(flat)
            wall = time.perf_counter() - start
            outcomes, at = [], 0
            for g in chosen:
                vs = verdicts[at: at + len(g)]
                at += len(g)
                outcomes.append(group_advantages([0.0] * len(g), vs, backoff))
            fallback = [o for o in outcomes if o.kind.value == "fallback"]
            ok = [(v, label) for v, label in zip(verdicts, labels, strict=True) if v.reward is not None]
            stats = teacher.stats()
            teacher.close()
            stage_b_runs = sum(v.stage_b_ran for v in verdicts)
            row = {
                "policy": ref, "name": policy.name, "version": policy.short_version,
                "stage_a_backend": policy.status_stage.backend or client.backend_id,
                "teacher_errors": sum(v.teacher_error for v in verdicts),
                "fallback_groups": len(fallback), "informative_groups": sum(o.informative for o in fallback),
                "informative_fallback_share": (sum(o.informative for o in fallback) / len(fallback)) if fallback else None,
                "spearman_reward_vs_label": spearman([float(v.reward) for v, _ in ok],
                                                     [LABEL_VALUE[label] for _, label in ok]),
                "stage_a_status": dict(Counter(v.stage_a_status.value for v in verdicts if v.stage_a_status)),
                "final_status": dict(Counter(v.status.value for v in verdicts if v.status)),
                "stage_b_runs": stage_b_runs, "ungrounded": sum(v.ungrounded for v in verdicts),
                "ungrounded_per_judged": sum(v.ungrounded for v in verdicts) / len(verdicts),
                "ungrounded_per_stage_b_run": (sum(v.ungrounded for v in verdicts) / stage_b_runs) if stage_b_runs else None,
                "reward_mean": sum(float(v.reward) for v, _ in ok) / len(ok) if ok else None,
                "rewarded_rollouts": sum(float(v.reward) > 0 for v, _ in ok),
                "seconds_per_rollout": round(wall / len(flat), 4),
                "tokens_per_rollout": {name: {"prompt": round(s.prompt_tokens / len(flat), 1),
                                              "completion": round(s.completion_tokens / len(flat), 1),
                                              "requests": s.requests}
                                       for name, s in stats.by_stage.items()},
                "load_avg_1min": round(os.getloadavg()[0], 2),
            }
            print(json.dumps({k: row[k] for k in ("policy", "informative_fallback_share", "spearman_reward_vs_label",
                                                  "ungrounded_per_judged", "seconds_per_rollout")}), flush=True)
            report["policies"].append(row)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
