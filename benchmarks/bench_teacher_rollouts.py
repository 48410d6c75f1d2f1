"""Real rollouts of the warm-started actor, for measuring teachers: training groups and held-out rollouts.

    python benchmarks/bench_teacher_rollouts.py --model WARM_START_DIR --train-questions 80 \
        --heldout-per-benchmark 24 --out results/teacher-signal/rollouts [--data DIR]

Writes two JSONL dumps of trajectories (token traces dropped), read by bench_teacher_quality.py and
bench_teacher_signal.py and by `eviback judge` / `eviback build-judge --rollouts`:

- `train_groups.jsonl`: G rollouts (temperature 1, the training setting) on a seeded sample of the embedded
  suite's *training* questions (a question of an evaluation file is refused); with `--unseen-by-judge`,
  only those an evidence judge held out of its training;
- `heldout.jsonl`: rollouts on the embedded suite's held-out questions (NQ and PopQA dev splits, HotpotQA,
  2WikiMultiHopQA and MuSiQue dev questions with their contexts), `--heldout-group` per question.

Settings follow the demo preset (2 searches, 160 tokens per turn, observations cut at 300 tokens, top 3).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import sys
import time
from pathlib import Path

from eviback.data import load_suite, read_questions, write_jsonl
from eviback.types import to_dict

HELDOUT = ("nq", "popqa", "hotpotqa", "2wikimultihopqa", "musique")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="the warm-started actor's directory (eviback sft prints it)")
    parser.add_argument("--train-questions", type=int, default=80)
    parser.add_argument("--group-size", type=int, default=5)
    parser.add_argument("--heldout-per-benchmark", type=int, default=24)
    parser.add_argument("--heldout-group", type=int, default=2)
    parser.add_argument("--max-turns", type=int, default=2)
    parser.add_argument("--max-turn-tokens", type=int, default=160)
    parser.add_argument("--max-obs-tokens", type=int, default=300)
    parser.add_argument("--batch-questions", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--unseen-by-judge", type=Path, metavar="JUDGE_DIR",
                        help="train groups only on the training questions this evidence judge held out of its "
                             "training (read from its judge.json), so that measuring it on them is fair")
    parser.add_argument("--judge-split", choices=("heldout", "train"),
                        help="train groups only on the training questions a judge built with --judge-share and "
                             "--judge-seed holds out (heldout) or trains on (train); the judge need not exist yet")
    parser.add_argument("--judge-share", type=float, default=0.15, help="the judge build's heldout_share")
    parser.add_argument("--judge-seed", type=int, default=0, help="the judge build's seed")
    parser.add_argument("--skip-questions", type=int, default=0,
                        help="leave out the first N questions of the seeded order (a second batch of groups)")
    parser.add_argument("--data", default=None, metavar="DIR",
                        help="data suite: its training and evaluation files and its corpus (default: the embedded one)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    from eviback.data import read_training_questions
    from eviback.generation import BackendConfig, load_backend
    from eviback.retrieval import suite_retriever
    from eviback.rollout import RolloutConfig, RolloutEngine

    suite = load_suite(args.data)
    rng = random.Random(args.seed)
    train = read_training_questions(suite)  # a question also in an evaluation file is left out, with a warning
    if args.unseen_by_judge:
        from eviback.teacher.evidence_judge import JUDGE_FILE
        from eviback.train.judge_builder import is_heldout

        built = json.loads((args.unseen_by_judge / JUDGE_FILE).read_text())["config"]
        train = [q for q in train if is_heldout(q.id, built["heldout_share"], built["seed"])]
    elif args.judge_split:
        from eviback.train.judge_builder import is_heldout

        held = args.judge_split == "heldout"
        train = [q for q in train if is_heldout(q.id, args.judge_share, args.judge_seed) is held]
    rng.shuffle(train)
    train = train[args.skip_questions: args.skip_questions + args.train_questions]
    heldout = []
    for name in HELDOUT:
        questions = [q for q in read_questions(suite.eval[name]) if q.gold_passage_ids]
        rng.shuffle(questions)
        heldout += questions[: args.heldout_per_benchmark]
    retriever = suite_retriever(suite)
    engine = RolloutEngine(load_backend(BackendConfig(model=args.model)), retriever, RolloutConfig(
        group_size=args.group_size, max_turns=args.max_turns, max_turn_tokens=args.max_turn_tokens,
        max_observation_tokens=args.max_obs_tokens, temperature=1.0))
    args.out.mkdir(parents=True, exist_ok=True)
    shown = [("DIR" if args.data and a == args.data else a) for a in (argv if argv is not None else sys.argv[1:])]
    report = {"command": "python benchmarks/bench_teacher_rollouts.py " + " ".join(shown),
              "settings": {k: ("DIR" if k == "data" and v else str(v)) for k, v in vars(args).items()}, "load_avg_start": os.getloadavg()[0]}
    for name, questions, group in (("train_groups", train, args.group_size), ("heldout", heldout, args.heldout_group)):
        trajectories, start = [], time.perf_counter()
        for at in range(0, len(questions), args.batch_questions):
            batch = engine.rollout(questions[at: at + args.batch_questions], group_size=group, seed=args.seed + at)
            trajectories += [dataclasses.replace(t, tokens=None) for t in batch.trajectories]
            print(f"{name}: {min(at + args.batch_questions, len(questions))}/{len(questions)} questions, "
                  f"{time.perf_counter() - start:.0f}s", flush=True)
        write_jsonl(args.out / f"{name}.jsonl", (to_dict(t) for t in trajectories))
        report[name] = {"questions": len(questions), "trajectories": len(trajectories),
                        "seconds": round(time.perf_counter() - start, 1)}
    report["load_avg_end"] = os.getloadavg()[0]
    (args.out / "rollouts.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
