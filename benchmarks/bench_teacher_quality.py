"""Stage A against the evidence labels on held-out questions: balanced accuracy, Cohen's kappa, confusion.

    python benchmarks/bench_teacher_quality.py --backend local --per-label 40 \
        --heldout results/teacher-signal/rollouts/heldout.jsonl \
        --policies two-stage single-prompt-dual-task JUDGE_DIR/policy.json \
        --out results/teacher-signal/quality.json

Evidence items, all on held-out questions of the embedded suite (NQ and PopQA dev splits, HotpotQA,
2WikiMultiHopQA and MuSiQue dev questions with contexts; a training question is refused):

- the rollouts of `--heldout` (real rollouts of the warm-started actor), each with its evidence as seen;
- real BM25 searches for each held-out question (the question, a shorter reformulation, the question with
  its gold answer, and a same-topic negative of retrieved passages without the answer), rendered and cut
  at `--max-obs-tokens` as the rollout engine cuts an observation.

Each item is labelled S/A/I by eviback.teacher.labels; up to `--per-label` items per label are drawn
(seeded), the rollouts first. Each policy is run up to its status stage (Stage A of two-stage; the single
prompt of the dual-task baseline, which sees the gold answers; Stage A of a judge policy is the trained
judge) and its statuses are compared with the labels. Also reported: teacher seconds and prompt tokens
per judged item.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from teacher_backends import add_backend_arguments, open_backend  # noqa: E402

from eviback.data import load_suite, read_questions  # noqa: E402
from eviback.teacher.judge import JudgeConfig, Teacher, read_trajectories  # noqa: E402
from eviback.teacher.labels import agreement, trajectory_label  # noqa: E402
from eviback.teacher.policy import TeacherPolicy, load_policy  # noqa: E402
from eviback.types import Status, to_dict  # noqa: E402

HELDOUT = ("nq", "popqa", "hotpotqa", "2wikimultihopqa", "musique")


def status_stage_only(policy: TeacherPolicy) -> TeacherPolicy:
    return TeacherPolicy(name=f"{policy.name}/status", stages=policy.stages[:1], weights=policy.weights)


def open_policy(ref: str) -> TeacherPolicy:
    from eviback.teacher.config import register_judge_beside

    register_judge_beside(ref)
    return load_policy(ref)


def items(args: argparse.Namespace) -> list[tuple[str, object]]:
    """(source, trajectory) of every held-out evidence item, rollouts first."""
    from eviback.policy import load_tokenizer
    from eviback.retrieval import suite_retriever
    from eviback.teacher.evidence_judge import seen_trajectory
    from eviback.teacher.workflow import answer_in_evidence
    from eviback.train.warmstart_data import retry_query, search_query, training_files

    suite = load_suite()
    training = {q.id for path in training_files(suite) for q in read_questions(path)}
    out = []
    for path in args.heldout:
        for t in read_trajectories(path):
            if t.question.id in training:
                raise ValueError(f"{path}: rollout on training question {t.question.id}; use held-out questions")
            out.append(("rollout", t))
    rng = random.Random(args.seed)
    questions = []
    for name in HELDOUT:
        qs = [q for q in read_questions(suite.eval[name]) if q.gold_passage_ids]
        rng.shuffle(qs)
        questions += qs[: args.questions_per_benchmark]
    assert not {q.id for q in questions} & training
    tokenizer = load_tokenizer()
    retriever = suite_retriever(suite)
    for q in questions:
        pool = {}
        for source, query in (("search", search_query(q)), ("reformulated", retry_query(q)),
                              ("answer-search", f"{search_query(q)} {q.golden_answers[0]}")):
            passages = list(retriever.search([query], args.topk)[0])
            pool.update({p.id: p for p in passages})
            out.append((source, seen_trajectory(q, passages, tokenizer, args.max_obs_tokens)))
        negatives = [p for p in pool.values() if not any(answer_in_evidence(g, p.contents) for g in q.golden_answers)]
        if negatives:
            out.append(("negative", seen_trajectory(q, negatives[: args.topk], tokenizer, args.max_obs_tokens)))
    retriever.close()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_backend_arguments(parser)
    parser.add_argument("--heldout", nargs="*", default=[], help="rollout dumps on held-out questions")
    parser.add_argument("--questions-per-benchmark", type=int, default=20)
    parser.add_argument("--per-label", type=int, default=40)
    parser.add_argument("--topk", type=int, default=3)
    parser.add_argument("--max-obs-tokens", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--policies", nargs="+", default=["two-stage", "single-prompt-dual-task"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)

    pool = [(source, t, trajectory_label(t)) for source, t in items(args)]
    pool = [x for x in pool if x[1].turns and any(turn.executed for turn in x[1].turns)]
    rng = random.Random(args.seed)
    chosen = []
    for label in (Status.SUFFICIENT, Status.AMBIGUOUS, Status.INSUFFICIENT):
        rollouts = [x for x in pool if x[2] is label and x[0] == "rollout"]
        searched = [x for x in pool if x[2] is label and x[0] != "rollout"]
        rng.shuffle(rollouts)
        rng.shuffle(searched)
        chosen += (rollouts + searched)[: args.per_label]
    labels = [x[2] for x in chosen]
    report = {
        "command": "python benchmarks/bench_teacher_quality.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "items": len(chosen), "labels": dict(Counter(s.value for s in labels)),
        "sources": dict(Counter(x[0] for x in chosen)),
        "pool": {"items": len(pool), "labels": dict(Counter(x[2].value for x in pool)),
                 "rollout_labels": dict(Counter(x[2].value for x in pool if x[0] == "rollout"))},
        "policies": [],
    }
    with open_backend(args) as client:
        for ref in args.policies:
            policy = open_policy(ref)
            teacher = Teacher(status_stage_only(policy), client, JudgeConfig(concurrency=args.concurrency))
            start = time.perf_counter()
            verdicts = teacher.judge([x[1] for x in chosen])
            wall = time.perf_counter() - start
            ok = [(label, v.stage_a_status) for label, v in zip(labels, verdicts, strict=True) if v.stage_a_status]
            a = agreement([p[0] for p in ok], [p[1] for p in ok])
            by_source = {}
            for source in sorted({x[0] for x in chosen}):
                pairs = [(x[2], v.stage_a_status) for x, v in zip(chosen, verdicts, strict=True)
                         if x[0] == source and v.stage_a_status]
                sa = agreement([p[0] for p in pairs], [p[1] for p in pairs])
                by_source[source] = {"n": sa.n, "accuracy": sa.accuracy}
            stats = teacher.stats().total
            teacher.close()
            row = {"policy": ref, "name": policy.name, "version": policy.short_version,
                   "stage_a_backend": policy.status_stage.backend or client.backend_id,
                   "sees_gold": policy.status_stage.sees_gold, "errors": len(verdicts) - len(ok),
                   **to_dict(a), "by_source": by_source,
                   "seconds_per_item": round(wall / len(chosen), 4),
                   "prompt_tokens_per_item": round(stats.prompt_tokens / len(chosen), 1),
                   "load_avg_1min": round(os.getloadavg()[0], 2)}
            print(json.dumps({k: row[k] for k in ("policy", "n", "balanced_accuracy", "s_vs_i_balanced_accuracy",
                                                  "kappa", "seconds_per_item")}), flush=True)
            report["policies"].append(row)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
