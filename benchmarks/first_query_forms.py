"""In which form did a policy write its first search? Read from the trajectories of an evaluation.

    python benchmarks/first_query_forms.py EVAL_DIR [EVAL_DIR ...] --out results/warmstart/first-query-forms.json

Each directory is an `eviback eval --out` directory (its `items.jsonl`, or an experiment's `items.jsonl.gz`).
For each item, the first `<search>` query is matched, after SQuAD normalisation, against the forms the warm
start writes for that question (`eviback.queries.query_forms`: the question as written, its keywords,
without its wh-word, subject and relation, the entity, the entity first). `other`: a query that is none of
them (a blend, or words of the model's own); `none`: no search. Per form: how many items, their mean F1, and the share of them with a
duplicate search (the same query searched twice). Greedy evaluation shows what a policy does at its mode:
a warm start whose draw over forms has no mode may blend them.

The warm start's answer turn names the passage it answers from ("Title (Doc 2) says: ..."; "Doc 2 (Title)"
before builder 4). `cited`: for each item whose last turn names one, the rank of the named passage in the
last observation, how often that passage holds a gold answer, and how often the first passage holding one
was at rank 1: a policy that reads well cites the passage that holds the answer, whatever its rank.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

from eviback.data import read_jsonl
from eviback.evaluate import items_path
from eviback.metrics import normalize_answer
from eviback.queries import query_forms
from eviback.types import Question


def first_query_form(item: dict) -> str:
    """The form of the item's first search, `other` or `none`."""
    q = item["trajectory"]["question"]
    question = Question(str(q["id"]), q["question"], tuple(q.get("golden_answers", ())), q.get("dataset", ""),
                        q.get("split", ""), q.get("metadata") or {})
    searches = [t["action"]["content"] for t in item["trajectory"]["turns"]
                if (t.get("action") or {}).get("kind") == "search"]
    if not searches:
        return "none"
    by_text = {normalize_answer(query): form.value for form, query in query_forms(question).items()}
    return by_text.get(normalize_answer(searches[0]), "other")


CITED = re.compile(r"Doc (\d+) \(|\(Doc (\d+)\)")  # builders 1-3: "Doc 2 (Title)"; 4 on: "Title (Doc 2)"


def cited_passage(item: dict) -> tuple[int, bool, int] | None:
    """(the rank the last turn names, whether that passage holds a gold answer, the rank of the first passage
    holding one, 0 for none) over the last observation; None when the last turn names no passage."""
    from eviback.teacher.workflow import answer_in_evidence

    turns = item["trajectory"]["turns"]
    shown = [t["passages"] for t in turns if t.get("passages")]
    match = CITED.search(turns[-1]["text"]) if turns else None
    if not shown or not match:
        return None
    golds = item["trajectory"]["question"].get("golden_answers", ())
    holds = [any(answer_in_evidence(g, p["contents"]) for g in golds) for p in shown[-1]]
    rank = int(match.group(1) or match.group(2))
    first = holds.index(True) + 1 if any(holds) else 0
    return rank, 0 < rank <= len(holds) and holds[rank - 1], first


def summarise_cited(items: list[dict]) -> dict:
    cited = [c for c in map(cited_passage, items) if c is not None]
    ranks: dict[int, int] = defaultdict(int)
    for rank, _, _ in cited:
        ranks[rank] += 1
    return {"items": len(cited), "rank": {str(k): ranks[k] for k in sorted(ranks)},
            "holds_gold": round(sum(h for _, h, _ in cited) / max(len(cited), 1), 4),
            "first_gold_at_rank_1": round(sum(f == 1 for _, _, f in cited) / max(len(cited), 1), 4)}


def summarise(eval_dir: Path) -> dict:
    rows: dict[str, list[dict]] = defaultdict(list)
    everything = list(read_jsonl(items_path(eval_dir)))
    for item in everything:
        rows[first_query_form(item)].append(item)
    total = sum(len(r) for r in rows.values())
    forms = {}
    for form, items in sorted(rows.items(), key=lambda kv: -len(kv[1])):
        forms[form] = {"items": len(items), "share": round(len(items) / total, 4),
                       "f1": round(sum(float(i["f1"]) for i in items) / len(items), 4),
                       "duplicate_search_share": round(sum(int(i["duplicate_searches"]) > 0 for i in items)
                                                       / len(items), 4)}
    return {"items": total, "forms": forms, "cited": summarise_cited(everything)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dirs", nargs="+", type=Path, help="eviback eval --out directories")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    report = {"command": "python benchmarks/first_query_forms.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "evaluations": {str(d): summarise(d) for d in args.dirs}}
    for d, summary in report["evaluations"].items():
        print(f"{d}: {summary['items']} items")
        print("| first search | items | share | F1 | with a duplicate search |\n|---|---:|---:|---:|---:|")
        for form, f in summary["forms"].items():
            print(f"| {form} | {f['items']} | {f['share']:.3f} | {f['f1']:.3f} | {f['duplicate_search_share']:.2f} |")
        c = summary["cited"]
        print(f"answers citing a passage: {c['items']}, by rank {c['rank']}, citing one that holds a gold answer "
              f"{c['holds_gold']:.3f}, the first such at rank 1 {c['first_gold_at_rank_1']:.3f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
