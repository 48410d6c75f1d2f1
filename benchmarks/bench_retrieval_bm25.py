"""bm25s (eviback's BM25) against rank_bm25 (the common pure-Python choice), on the same corpus and questions.

    python benchmarks/bench_retrieval_bm25.py DATA_DIR [--questions 1000] [--topk 3]

DATA_DIR is a data suite in the FlashRAG release layout (`corpus/wiki_mini.jsonl`, `qa/nq.jsonl`). Both
libraries get the same tokens (lower-cased words, English stopwords removed) and the same k1/b; they differ
in the IDF formula (Lucene's vs Okapi's), so their top-k overlap is high but not total. Speed is measured
in one process, one after the other, so the ratio is meaningful even on a busy machine. Times include
query tokenisation and, for eviback, fetching the passages. Needs `pip install 'eviback[bench]'`.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from eviback.data import read_questions
from eviback.retrieval import BM25Config, build_index, load_retriever
from eviback.retrieval.store import PassageStore


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data_dir", type=Path)
    parser.add_argument("--questions", type=int, default=1000)
    parser.add_argument("--topk", type=int, default=3)
    args = parser.parse_args(argv)
    from bm25s.tokenization import Tokenizer
    from rank_bm25 import BM25Okapi

    corpus = args.data_dir / "corpus" / "wiki_mini.jsonl"
    questions = [q.question for q in read_questions(args.data_dir / "qa" / "nq.jsonl")[: args.questions]]
    config = BM25Config()
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        build_index(corpus, Path(tmp) / "index", progress=False)
        eviback_build = time.perf_counter() - started
        retriever = load_retriever(Path(tmp) / "index")
        store = PassageStore(Path(tmp) / "index")
        texts = [p.contents for p in store]
        ids = [p.id for p in store]

        started = time.perf_counter()
        tokenizer = Tokenizer(lower=True, stopwords=config.stopwords)
        corpus_tokens = tokenizer.tokenize(texts, update_vocab=True, return_as="string", show_progress=False)
        rank = BM25Okapi(corpus_tokens, k1=config.k1, b=config.b)
        rank_build = time.perf_counter() - started

        retriever.search(["warm up"], topk=args.topk)  # load the compiled search loop before timing
        started = time.perf_counter()
        batched = retriever.search(questions, topk=args.topk)
        eviback_batched = time.perf_counter() - started
        started = time.perf_counter()
        single = [retriever.search([q], topk=args.topk)[0] for q in questions]
        eviback_single = time.perf_counter() - started

        started = time.perf_counter()
        rank_top = []
        for question in questions:
            tokens = tokenizer.tokenize([question], update_vocab=False, return_as="string", show_progress=False)[0]
            scores = rank.get_scores([t for t in tokens if t])
            best = np.argsort(-scores, kind="stable")[: args.topk]
            rank_top.append([ids[i] for i in best if scores[i] > 0])
        rank_time = time.perf_counter() - started
        retriever.close()
        store.close()

    n = len(questions)
    ours = [[p.id for p in ps] for ps in batched]
    assert ours == [[p.id for p in ps] for ps in single], "batched and one-by-one search disagree"
    overlap = np.mean([len(set(a) & set(b)) / args.topk for a, b in zip(ours, rank_top, strict=True)])
    top1 = np.mean([bool(a) and bool(b) and a[0] == b[0] for a, b in zip(ours, rank_top, strict=True)])
    print(f"corpus: {len(ids)} passages; {n} questions from nq.jsonl; top-{args.topk}; "
          f"k1={config.k1} b={config.b}, stopwords={config.stopwords}")
    print(f"index build:        eviback (bm25s) {eviback_build:.2f} s (streaming, passage store included); "
          f"rank_bm25 {rank_build:.2f} s")
    print(f"eviback batched:    {n / eviback_batched:10.0f} queries/s ({eviback_batched:.3f} s)")
    print(f"eviback one by one: {n / eviback_single:10.0f} queries/s ({eviback_single:.3f} s)")
    print(f"rank_bm25:          {n / rank_time:10.1f} queries/s ({rank_time:.2f} s)")
    print(f"speed-up over rank_bm25: {rank_time / eviback_batched:.0f}x batched, "
          f"{rank_time / eviback_single:.0f}x one query per call")
    print(f"top-{args.topk} overlap with rank_bm25: {overlap:.3f}; same top-1: {top1:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
