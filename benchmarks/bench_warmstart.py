"""Before/after figures of the warm start, on the real rollout engine (results/warmstart.md quotes them).

For one policy (the base model or a warm-started directory):

- greedy evaluation on held-out questions (the suite's evaluation files, the first `--limit` of each):
  valid-answer rate, EM, F1, average searches, duplicate-query and forced-termination rates;
- with `--groups N`: N training questions rolled out `--group-size` times at temperature 1, and the share of
  all-zero groups (no rollout with EM = 1), the regime the teacher targets.

    python benchmarks/bench_warmstart.py --model smollm2-135m --out results/warmstart/base.json
    python benchmarks/bench_warmstart.py --warm-start --max-examples 200 --out results/warmstart/ws200.json

`--warm-start` trains (or reuses from the cache) the warm start of `--model` with the given settings
first and evaluates that. Run each policy in its own process: a vLLM engine stays loaded per process.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import random
import sys
import time
from pathlib import Path

# Sleeping OpenMP threads: on shared cores, spinning ones made training steps ~10x slower (see results).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="policy, or the base of --warm-start")
    parser.add_argument("--warm-start", action="store_true", help="warm-start --model first (cached)")
    parser.add_argument("--max-examples", type=int, default=200)
    parser.add_argument("--epochs", type=float, default=1.0)
    parser.add_argument("--max-obs-tokens", type=int, default=500, help="warm start and rollouts")
    parser.add_argument("--benchmarks", nargs="*", default=["nq", "popqa", "hotpotqa"])
    parser.add_argument("--limit", type=int, default=50, help="questions per benchmark")
    parser.add_argument("--max-turns", type=int, default=4)
    parser.add_argument("--groups", type=int, default=0, help="training questions for the all-zero share")
    parser.add_argument("--group-size", type=int, default=5)
    parser.add_argument("--backend", default="vllm", choices=("vllm", "hf"))
    parser.add_argument("--out", required=True, help="JSON file for the figures")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from eviback.data import load_suite, read_questions
    from eviback.evaluate import evaluate
    from eviback.generation import BackendConfig, load_backend
    from eviback.metrics import exact_match
    from eviback.retrieval import suite_retriever
    from eviback.rollout import RolloutConfig, RolloutEngine
    from eviback.train.sft import WarmStartConfig, peak_rss_gb, warm_start

    suite = load_suite()
    retriever = suite_retriever(suite)
    result: dict = {"argv": sys.argv[1:]}
    model = args.model
    if args.warm_start:
        started = time.perf_counter()
        config = WarmStartConfig(model=args.model, max_examples=args.max_examples, epochs=args.epochs,
                                 max_observation_tokens=args.max_obs_tokens)
        model = str(warm_start(config, retriever=retriever))
        result["warm_start"] = json.loads((Path(model) / "sft_report.json").read_text())
        result["warm_start_wall_s"] = round(time.perf_counter() - started, 1)
    result["model"] = model

    backend = load_backend(BackendConfig(backend=args.backend, model=model))
    rollout = RolloutConfig(max_turns=args.max_turns, max_observation_tokens=args.max_obs_tokens)
    result["eval"] = {}
    items = []  # every evaluated trajectory, next to the figures, to read what the policy did
    for name in args.benchmarks:
        questions = read_questions(suite.eval[name])[: args.limit]
        started = time.perf_counter()
        evaluated = evaluate(backend, retriever, questions, config=rollout, benchmark=name)
        result["eval"][name] = {**dataclasses.asdict(evaluated.metrics),
                                "seconds": round(time.perf_counter() - started, 1)}
        logging.info("%s: %s", name, result["eval"][name])
        items += [{"benchmark": name, "id": i.trajectory.question.id, "question": i.trajectory.question.question,
                   "golden_answers": list(i.trajectory.question.golden_answers), "answer": i.trajectory.answer,
                   "em": i.scores.em, "searches": i.stats.searches, "response": i.trajectory.response}
                  for i in evaluated.items]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(Path(args.out).with_suffix(".items.jsonl"), "w", encoding="utf-8") as f:
        f.writelines(json.dumps(item, ensure_ascii=False) + "\n" for item in items)

    if args.groups:
        questions = [q for path in suite.train for q in read_questions(path)]
        questions = random.Random(0).sample(questions, args.groups)
        engine = RolloutEngine(backend, retriever, dataclasses.replace(rollout, group_size=args.group_size,
                                                                       temperature=1.0))
        started = time.perf_counter()
        groups = []
        for start in range(0, len(questions), 8):  # 40 sequences per call keeps the KV cache from thrashing
            groups += engine.rollout(questions[start : start + 8], seed=start).groups
        hits = [[exact_match(t.answer, g.question.golden_answers) for t in g.trajectories] for g in groups]
        searches = [len(t.queries) for g in groups for t in g.trajectories]
        result["groups"] = {
            "groups": len(hits),
            "group_size": args.group_size,
            "all_zero_share": sum(max(h) == 0 for h in hits) / len(hits),
            "rollout_em": sum(map(sum, hits)) / (len(hits) * args.group_size),
            "valid_answer_rate": sum(t.answer is not None for g in groups for t in g.trajectories)
            / len(searches),
            "avg_searches": sum(searches) / len(searches),
            "seconds": round(time.perf_counter() - started, 1),
        }
        logging.info("groups: %s", result["groups"])
    result["peak_rss_gb"] = round(peak_rss_gb(), 2)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
