"""Build the small dataset embedded in the package from the FlashRAG-style data release.

    python scripts/build_embedded_data.py --source /path/to/data --out src/eviback/embedded

`--source` is a directory in the release layout (DATA.md: `corpus/wiki_mini.jsonl`, `qa/...`). The output
is deterministic (questions are chosen by a hash of their id), holds every passage the chosen questions
need (gold passages, and the full context sets of the multi-hop questions) plus a fixed sample of other
passages as distractors, and is described by `suite.json` so `eviback.data.load_suite()` finds it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
from pathlib import Path

from eviback.data import iter_corpus, question_to_json, read_questions, write_corpus, write_jsonl

# (name in the suite, source file, how many questions)
TRAIN = [
    ("nq_train", "qa/splits/nq_oracle_train.jsonl", 300),
    ("popqa_train", "qa/splits/popqa_train.jsonl", 150),
    ("hotpotqa_train", "qa/train/hotpotqa_train_hipporag100.jsonl", 100),
    ("musique_train", "qa/train/musique_train_hipporag100.jsonl", 100),
]
EVAL = [
    ("nq", "qa/splits/nq_oracle_dev.jsonl", 100),
    ("triviaqa", "qa/triviaqa.jsonl", 50),
    ("popqa", "qa/splits/popqa_dev.jsonl", 100),
    ("hotpotqa", "qa/hotpotqa_ctx.jsonl", 60),
    ("2wikimultihopqa", "qa/2wikimultihopqa_ctx.jsonl", 60),
    ("musique", "qa/musique_ctx.jsonl", 60),
    ("bamboogle", "qa/bamboogle.jsonl", 50),
]
DISTRACTORS = 2500


def _rank(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--source", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=Path("src/eviback/embedded"))
    args = parser.parse_args()

    passages = {p.id: p for p in iter_corpus(args.source / "corpus/wiki_mini.jsonl")}
    by_title: dict[str, list[str]] = {}
    for p in passages.values():
        by_title.setdefault(p.title, []).append(p.id)

    needed: set[str] = set()
    suite = {"corpus": "corpus.jsonl.gz", "train": [], "eval": {}}
    if args.out.exists():
        shutil.rmtree(args.out)
    (args.out / "qa").mkdir(parents=True)

    for kind, specs in (("train", TRAIN), ("eval", EVAL)):
        for name, rel, count in specs:
            questions = sorted(read_questions(args.source / rel), key=lambda q: _rank(q.id))[:count]
            records = []
            for q in questions:
                record = question_to_json(q)
                meta = dict(q.metadata)
                ids = list(meta.get("context_passage_ids", [])) + list(q.gold_passage_ids)
                if not ids and meta.get("supporting_titles"):
                    # the multi-hop train extras name their supporting paragraphs by title only
                    gold = [i for t in meta["supporting_titles"] for i in by_title.get(t, [])]
                    meta["gold_passage_ids"] = gold
                    record["metadata"] = meta
                    ids = gold
                needed.update(i for i in ids if i in passages)
                records.append(record)
            path = f"qa/{name}.jsonl.gz"
            write_jsonl(args.out / path, records)
            if kind == "train":
                suite["train"].append(path)
            else:
                suite["eval"][name] = path

    others = sorted((i for i in passages if i not in needed), key=_rank)[:DISTRACTORS]
    chosen = sorted(needed | set(others), key=lambda i: (len(i), i))
    write_corpus(args.out / "corpus.jsonl.gz", (passages[i] for i in chosen))
    (args.out / "suite.json").write_text(json.dumps(suite, indent=2) + "\n")
    shutil.copy(Path(__file__).with_name("EMBEDDED_DATA_ATTRIBUTION.md"), args.out / "ATTRIBUTION.md")
    print(f"{len(chosen)} passages ({len(needed)} needed, {len(others)} distractors) -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
