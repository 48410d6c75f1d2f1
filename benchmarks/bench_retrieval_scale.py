"""BM25 at scale: a synthetic corpus of 1M passages: index time, peak memory, queries/s.

    python benchmarks/bench_retrieval_scale.py WORK_DIR [--passages 1000000] [--queries 1000]

Writes `WORK_DIR/synthetic.jsonl` (~60 words per passage, drawn from a Zipf-distributed vocabulary of 200k
made-up words, like natural text's word frequencies; ~430 MB for 1M passages) unless it is already there,
then runs `eviback index` on it in a child process and a search run in another, each reporting its own
peak resident memory (ru_maxrss). Query words are drawn from the same distribution (3-8 per query).
Delete WORK_DIR afterwards.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

VOCABULARY = 200_000
SYLLABLES = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]  # 70 syllables, 24M words of 2-4


def make_words(n: int, rng: np.random.Generator) -> list[str]:
    """`n` distinct pronounceable made-up words (2-4 syllables)."""
    words: set[str] = set()
    while len(words) < n:
        parts = rng.integers(0, len(SYLLABLES), size=(n, 4))
        lengths = rng.integers(2, 5, size=n)
        words.update("".join(SYLLABLES[p] for p in row[:length]) for row, length in zip(parts, lengths, strict=True))
    chosen = sorted(words)
    rng.shuffle(chosen)  # so frequent words are not all alike
    return chosen[:n]


def zipf_ids(rng: np.random.Generator, size: int) -> np.ndarray:
    return (rng.zipf(1.1, size=size) - 1) % VOCABULARY


def write_corpus(path: Path, passages: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    words = np.array(make_words(VOCABULARY, rng), dtype=object)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        for start in range(0, passages, 10_000):
            count = min(10_000, passages - start)
            lengths = rng.integers(40, 81, size=count)
            ids = zipf_ids(rng, int(lengths.sum()))
            offset = 0
            for i in range(count):
                text = " ".join(words[ids[offset:offset + lengths[i]]])
                offset += lengths[i]
                title = " ".join(words[ids[offset - 2:offset]]).title()
                f.write(json.dumps({"id": str(start + i), "contents": f'"{title}"\n{text}'}) + "\n")
    tmp.rename(path)


def child_build(corpus: Path, index: Path) -> dict:
    from eviback.retrieval import build_index

    started = time.perf_counter()
    build_index(corpus, index, progress=False, force=True)
    return {"seconds": time.perf_counter() - started}


def child_search(index: Path, queries: int) -> dict:
    from eviback.retrieval import load_retriever

    rng = np.random.default_rng(1)
    words = make_words(VOCABULARY, np.random.default_rng(0))
    lengths = rng.integers(3, 9, size=queries)
    ids = zipf_ids(rng, int(lengths.sum()))
    texts, offset = [], 0
    for length in lengths:
        texts.append(" ".join(words[i] for i in ids[offset:offset + length]))
        offset += length
    started = time.perf_counter()
    retriever = load_retriever(index)
    retriever.search(["warm up"], topk=3)
    load = time.perf_counter() - started
    started = time.perf_counter()
    batched = retriever.search(texts, topk=3)
    batched_s = time.perf_counter() - started
    started = time.perf_counter()
    for text in texts[:200]:
        retriever.search([text], topk=3)
    single_s = time.perf_counter() - started
    return {"load_seconds": load, "batched_qps": queries / batched_s, "single_qps": 200 / single_s,
            "found": sum(bool(r) for r in batched) / queries}


def run_child(*args: str) -> dict:
    output = subprocess.run([sys.executable, __file__, "--child", *args], check=True, capture_output=True,
                            text=True).stdout
    return json.loads(output.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("work_dir", type=Path, nargs="?")
    parser.add_argument("--passages", type=int, default=1_000_000)
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)  # build CORPUS INDEX | search INDEX N
    args = parser.parse_args(argv)
    if args.child:
        mode, *rest = args.child
        result = child_build(Path(rest[0]), Path(rest[1])) if mode == "build" else child_search(Path(rest[0]), int(rest[1]))
        result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
        print(json.dumps(result))
        return 0

    if args.work_dir is None:
        parser.error("WORK_DIR is required")
    args.work_dir.mkdir(parents=True, exist_ok=True)
    corpus = args.work_dir / f"synthetic-{args.passages}.jsonl"
    if not corpus.exists():
        started = time.perf_counter()
        write_corpus(corpus, args.passages)
        print(f"wrote {corpus} ({corpus.stat().st_size / 1e6:.0f} MB) in {time.perf_counter() - started:.0f} s", flush=True)
    index = args.work_dir / f"index-{args.passages}"
    build = run_child("build", str(corpus), str(index))
    size = sum(p.stat().st_size for p in index.rglob("*") if p.is_file())
    print(f"BM25 index of {args.passages:,} passages: {build['seconds']:.1f} s, peak RSS {build['peak_rss_mb']:.0f} MB, "
          f"{size / 1e6:.0f} MB on disk (passage copy included)", flush=True)
    search = run_child("search", str(index), str(args.queries))
    print(f"load + warm-up {search['load_seconds']:.1f} s; {args.queries} queries top-3: "
          f"{search['batched_qps']:.0f} queries/s batched, {search['single_qps']:.0f} queries/s one by one; "
          f"peak RSS {search['peak_rss_mb']:.0f} MB; {search['found']:.2f} of queries found a passage")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
