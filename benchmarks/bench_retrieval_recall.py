"""Retrieval quality: recall of the gold passages at 3 and 10, BM25 against dense, per benchmark.

    python benchmarks/bench_retrieval_recall.py DATA_DIR [--bm25 INDEX_DIR] [--dense INDEX_DIR]

DATA_DIR is a data suite in the FlashRAG release layout; the question files used are those whose lines
carry `metadata.gold_passage_ids` (nq_oracle, popqa, hotpotqa_ctx, 2wikimultihopqa_ctx, musique_ctx).
The query is the question as written. Without --bm25 / --dense the indexes of the suite's corpus are built
once into eviback's cache (the dense one takes minutes on a CPU) and reused.

recall@k: the share of a question's gold passages found in the top k, averaged over questions (a
multi-hop question with 4 gold passages cannot reach 1 at k=3). hit@k: the share of questions with at
least one gold passage in the top k. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from eviback.data import load_suite, read_questions
from eviback.retrieval import open_retriever

BENCHMARKS = ("nq_oracle", "popqa", "hotpotqa_ctx", "2wikimultihopqa_ctx", "musique_ctx")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data_dir", type=Path)
    parser.add_argument("--bm25", help="BM25 index directory (default: the suite's, cached)")
    parser.add_argument("--dense", help="dense index directory (default: the suite's, cached)")
    parser.add_argument("--kinds", default="bm25,dense", help="which retrievers to compare (default: bm25,dense)")
    args = parser.parse_args(argv)
    suite = load_suite(args.data_dir)
    rows = []
    for kind in args.kinds.split(","):
        spec = getattr(args, kind)
        retriever = open_retriever(spec, suite, kind)
        for name in BENCHMARKS:
            questions = [q for q in read_questions(args.data_dir / "qa" / f"{name}.jsonl") if q.gold_passage_ids]
            started = time.perf_counter()
            results = retriever.search([q.question for q in questions], topk=10)
            seconds = time.perf_counter() - started
            row = {"benchmark": name, "kind": kind, "n": len(questions), "qps": len(questions) / seconds}
            for k in (3, 10):
                found = [len(set(q.gold_passage_ids) & {p.id for p in ps[:k]}) for q, ps in zip(questions, results, strict=True)]
                row[f"recall@{k}"] = sum(f / len(q.gold_passage_ids) for f, q in zip(found, questions, strict=True)) / len(questions)
                row[f"hit@{k}"] = sum(f > 0 for f in found) / len(questions)
            rows.append(row)
            print(f"{kind:5s} {name:20s} n={row['n']:5d} recall@3={row['recall@3']:.3f} recall@10={row['recall@10']:.3f} "
                  f"hit@3={row['hit@3']:.3f} hit@10={row['hit@10']:.3f} ({row['qps']:.0f} queries/s)", flush=True)
        retriever.close()
    kinds = args.kinds.split(",")
    print()
    print("| benchmark | questions | " + " | ".join(f"{kind} R@3 | {kind} R@10" for kind in kinds)
          + " | " + " | ".join(f"{kind} hit@3 | {kind} hit@10" for kind in kinds) + " |")
    print("|---|---:|" + "---:|" * (4 * len(kinds)))
    for name in BENCHMARKS:
        by_kind = {r["kind"]: r for r in rows if r["benchmark"] == name}
        n = next(iter(by_kind.values()))["n"]
        cells = [f"{by_kind[k]['recall@3']:.3f} | {by_kind[k]['recall@10']:.3f}" for k in kinds]
        hits = [f"{by_kind[k]['hit@3']:.3f} | {by_kind[k]['hit@10']:.3f}" for k in kinds]
        print(f"| {name} | {n} | " + " | ".join(cells) + " | " + " | ".join(hits) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
