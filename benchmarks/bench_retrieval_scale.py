"""BM25 at scale: a synthetic corpus of 1M passages: index time, peak memory, queries/s.

    python benchmarks/bench_retrieval_scale.py WORK_DIR [--passages 1000000] [--queries 1000] [--reuse]

Writes `WORK_DIR/synthetic.jsonl` (~60 words per passage, drawn from a Zipf-distributed vocabulary of 200k
made-up words, like natural text's word frequencies; ~430 MB for 1M passages) unless it is already there,
then runs `eviback index` on it in a child process and a search run in another, each reporting its own
peak resident memory (ru_maxrss). Queries have 3-8 words, drawn two ways (see `child_search`).
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

    words = make_words(VOCABULARY, np.random.default_rng(0))
    started = time.perf_counter()
    retriever = load_retriever(index)
    retriever.search(["warm up"], topk=3)
    result = {"load_seconds": time.perf_counter() - started}
    # "zipf": query words drawn like passage words, so most queries contain a few words that occur in
    # nearly every passage (the top ranks of a Zipf law are this corpus's stopwords) and BM25 must score
    # ~1M postings for each: the worst case. "content": the 100 most frequent words left out, as English
    # stopword removal leaves real queries.
    for name, skip in (("zipf", 0), ("content", 100)):
        rng = np.random.default_rng(1)
        texts = []
        for length in rng.integers(3, 9, size=queries):
            ids = zipf_ids(rng, 4 * int(length))
            texts.append(" ".join(words[i] for i in ids[ids >= skip][:length]))
        started = time.perf_counter()
        batched = retriever.search(texts, topk=3)
        result[f"{name}_batched_qps"] = queries / (time.perf_counter() - started)
        started = time.perf_counter()
        for text in texts[:200]:
            retriever.search([text], topk=3)
        result[f"{name}_single_qps"] = 200 / (time.perf_counter() - started)
        result[f"{name}_found"] = sum(bool(r) for r in batched) / queries
    return result


def run_child(*args: str) -> dict:
    output = subprocess.run([sys.executable, __file__, "--child", *args], check=True, capture_output=True,
                            text=True).stdout
    return json.loads(output.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("work_dir", type=Path, nargs="?")
    parser.add_argument("--passages", type=int, default=1_000_000)
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--reuse", action="store_true", help="search an index built by an earlier run")
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
    if not (args.reuse and (index / "manifest.json").exists()):
        build = run_child("build", str(corpus), str(index))
        size = sum(p.stat().st_size for p in index.rglob("*") if p.is_file())
        print(f"BM25 index of {args.passages:,} passages: {build['seconds']:.1f} s, peak RSS "
              f"{build['peak_rss_mb']:.0f} MB, {size / 1e6:.0f} MB on disk (passage copy included)", flush=True)
    search = run_child("search", str(index), str(args.queries))
    print(f"load + warm-up {search['load_seconds']:.1f} s; search peak RSS {search['peak_rss_mb']:.0f} MB")
    for name in ("zipf", "content"):
        print(f"{name:7s} queries, top-3: {search[f'{name}_batched_qps']:.0f} queries/s batched, "
              f"{search[f'{name}_single_qps']:.0f} queries/s one by one; "
              f"{search[f'{name}_found']:.2f} of queries found a passage")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
