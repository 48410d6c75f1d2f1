"""Does the teacher give all-zero groups a learning signal? Measured on real warm-started rollouts.

    python benchmarks/bench_teacher_signal.py --backend local --groups 50 \
        --rollouts results/teacher-signal/rollouts/train_groups.jsonl \
        --policies two-stage JUDGE_DIR/policy.json --out results/teacher-signal/signal.json

The rollouts are G per training question (bench_teacher_rollouts.py). The first `--groups` groups in which
no rollout has EM 1 (the groups EviBack hands to the teacher) are judged by each policy, whole workflow
(Stage A, then Stage B on S/A with its grounding). A policy named `f1-fallback` is the partial-credit rule
(each rollout's own token F1 against the gold, no teacher: eviback.backoff's f1-fallback mode); `oracle`
is the ceiling (Stage A from the evidence label: it reads the gold). Reported per policy:

- the informative fallback share: groups whose fallback advantages are not all zero (eviback.backoff);
- Spearman's rho between a rollout's reward and its evidence label's value (S 1, A 0.5, I 0);
- the reward given to I-labelled evidence (mean, and the share of such rollouts rewarded at all): evidence
  that does not hold the answer should earn nothing;
- Stage A against the labels: the gate (I vs not-I) balanced accuracy, S-vs-I balanced accuracy, kappa;
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

from teacher_backends import add_backend_arguments, open_backend

from eviback.backoff import BackoffConfig, Mode, group_advantages
from eviback.metrics import exact_match, f1_score
from eviback.teacher.judge import JudgeConfig, Teacher, read_trajectories
from eviback.teacher.labels import LABEL_VALUE, agreement, trajectory_label
from eviback.teacher.policy import load_policy
from eviback.teacher.workflow import evidence_as_seen
from eviback.types import Status


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


def diversity(groups: list[list], labels: list[Status]) -> dict:
    """Mean distinct queries, evidence sets and labels per judged group (what a group could tell apart)."""
    at, queries, evidence, kinds = 0, [], [], []
    for g in groups:
        queries.append(len({tuple(turn.action.content for turn in t.turns if turn.executed) for t in g}))
        evidence.append(len({tuple(e.text for e in evidence_as_seen(t)) for t in g}))
        kinds.append(len(set(labels[at: at + len(g)])))
        at += len(g)
    n = len(groups) or 1
    return {"distinct_queries": sum(queries) / n, "distinct_evidence": sum(evidence) / n,
            "distinct_labels": sum(kinds) / n, "groups_with_label_variation": sum(k > 1 for k in kinds)}


def reward_figures(name: str, chosen: list[list], rewards: list[float | None], labels: list[Status],
                   backoff: BackoffConfig, verdicts: list | None = None) -> dict:
    """The figures every teacher and rule is compared on, from one reward per rollout (None: an error)."""
    outcomes, at = [], 0
    for g in chosen:
        em = [0.0] * len(g)
        part = rewards[at: at + len(g)]
        if backoff.mode is Mode.F1_FALLBACK:
            outcomes.append(group_advantages(em, None, backoff, f1=part))
        else:
            outcomes.append(group_advantages(em, verdicts[at: at + len(g)], backoff))
        at += len(g)
    fallback = [o for o in outcomes if o.kind.value == "fallback"]
    ok = [(r, label) for r, label in zip(rewards, labels, strict=True) if r is not None]
    on_i = [r for r, label in ok if label is Status.INSUFFICIENT]
    return {
        "policy": name, "fallback_groups": len(fallback), "informative_groups": sum(o.informative for o in fallback),
        "informative_fallback_share": (sum(o.informative for o in fallback) / len(fallback)) if fallback else None,
        "spearman_reward_vs_label": spearman([float(r) for r, _ in ok], [LABEL_VALUE[label] for _, label in ok]),
        "reward_mean": sum(float(r) for r, _ in ok) / len(ok) if ok else None,
        "rewarded_rollouts": sum(float(r) > 0 for r, _ in ok),
        "i_labelled": len(on_i), "i_reward_mean": sum(on_i) / len(on_i) if on_i else None,
        "i_rewarded_share": sum(r > 0 for r in on_i) / len(on_i) if on_i else None,
        "reward_mean_by_label": {s.value: (sum(r for r, label in ok if label is s)
                                           / max(1, sum(label is s for _, label in ok)))
                                 for s in (Status.SUFFICIENT, Status.AMBIGUOUS, Status.INSUFFICIENT)},
    }


def f1_row(chosen: list[list], labels: list[Status]) -> dict:
    """The partial-credit rule: each rollout's own token F1 against the gold (no answer: 0), no teacher."""
    start = time.perf_counter()
    rewards = [f1_score(t.answer, t.question.golden_answers) if t.answer else 0.0 for g in chosen for t in g]
    row = reward_figures("f1-fallback", chosen, rewards, labels, BackoffConfig(mode=Mode.F1_FALLBACK))
    row.update(name="f1-fallback", sees_gold=True, stage_a_gate_balanced_accuracy=None,
               seconds_per_rollout=round((time.perf_counter() - start) / max(1, len(rewards)), 6))
    return row


def policy_row(ref: str, client, chosen: list[list], flat: list, labels: list[Status],
               args: argparse.Namespace) -> dict:
    from eviback.teacher.config import register_judge_beside

    register_judge_beside(ref)
    policy = load_policy(ref)
    teacher = Teacher(policy, client, JudgeConfig(concurrency=args.concurrency))
    start = time.perf_counter()
    verdicts = teacher.judge(flat)
    wall = time.perf_counter() - start
    stats = teacher.stats()
    teacher.close()
    row = reward_figures(ref, chosen, [None if v.reward is None else float(v.reward) for v in verdicts], labels,
                         BackoffConfig(), verdicts)
    judged = [(label, v.stage_a_status) for label, v in zip(labels, verdicts, strict=True) if v.stage_a_status]
    a = agreement([x for x, _ in judged], [y for _, y in judged])
    stage_b_runs = sum(v.stage_b_ran for v in verdicts)
    row.update({
        "name": policy.name, "version": policy.short_version, "oracle": policy.is_oracle,
        "stage_a_backend": policy.status_stage.backend or client.backend_id,
        "teacher_errors": sum(v.teacher_error for v in verdicts),
        "stage_a_gate_balanced_accuracy": a.gate_balanced_accuracy,
        "stage_a_s_vs_i_balanced_accuracy": a.s_vs_i_balanced_accuracy, "stage_a_kappa": a.kappa,
        "stage_a_confusion": a.confusion,
        "stage_a_status": dict(Counter(v.stage_a_status.value for v in verdicts if v.stage_a_status)),
        "final_status": dict(Counter(v.status.value for v in verdicts if v.status)),
        "stage_b_runs": stage_b_runs, "ungrounded": sum(v.ungrounded for v in verdicts),
        "ungrounded_per_judged": sum(v.ungrounded for v in verdicts) / len(verdicts),
        "ungrounded_per_stage_b_run": (sum(v.ungrounded for v in verdicts) / stage_b_runs) if stage_b_runs else None,
        "seconds_per_rollout": round(wall / len(flat), 4),
        "tokens_per_rollout": {name: {"prompt": round(s.prompt_tokens / len(flat), 1),
                                      "completion": round(s.completion_tokens / len(flat), 1),
                                      "requests": s.requests}
                               for name, s in stats.by_stage.items()},
    })
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_backend_arguments(parser)
    parser.add_argument("--rollouts", required=True, help="train_groups.jsonl of bench_teacher_rollouts.py")
    parser.add_argument("--groups", type=int, default=50)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--policies", nargs="+", default=["two-stage"])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)

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
    report["diversity"] = diversity(chosen, labels)
    with open_backend(args) as client:
        for ref in args.policies:
            row = f1_row(chosen, labels) if ref == "f1-fallback" else policy_row(ref, client, chosen, flat, labels, args)
            row["load_avg_1min"] = round(os.getloadavg()[0], 2)
            print(json.dumps({k: row[k] for k in ("policy", "informative_fallback_share", "spearman_reward_vs_label",
                                                  "i_reward_mean", "stage_a_gate_balanced_accuracy",
                                                  "seconds_per_rollout")}), flush=True)
            report["policies"].append(row)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
