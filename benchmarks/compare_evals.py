"""Two policies on the same held-out questions: paired bootstrap intervals of after - before.

    python benchmarks/compare_evals.py BEFORE_EVAL_DIR AFTER_EVAL_DIR [MORE_BEFORE MORE_AFTER ...] \
        --out results/warmstart/forms.json

Each directory is an `eviback eval --out` directory (its `items.jsonl`, or the `items.jsonl.gz` an experiment
keeps). Pairs of directories are read in
order (before, after); items are keyed by (benchmark, question id), so several pairs over different
benchmarks or suites pool into one comparison (a suite's benchmark is prefixed by its pair's index when two
pairs share a benchmark name). For F1, EM, valid answers, searches, duplicate searches and forced endings:
the macro averages over benchmarks of each side, and `eviback.stats.paired_bootstrap`'s 95% interval of the
difference (items resampled within each benchmark), overall and per benchmark; and how many answers differ.

F1 splits into searching and answering: `gold_in_evidence` is whether a gold answer was in the evidence the
policy saw (its observations as cut, as the precondition counts it), and `answering` compares F1 over the
items where both policies' evidence held a gold answer, so that a difference there is one of reading, not of
retrieval.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from eviback.data import read_jsonl
from eviback.evaluate import items_path
from eviback.metrics import normalize_answer
from eviback.stats import paired_bootstrap

METRICS = ("f1", "em", "valid_answer", "searches", "duplicate_searches", "forced", "gold_in_evidence")


def gold_in_evidence(record: dict) -> float:
    """1.0 when a gold answer was in the evidence the policy saw (whole words, normalised)."""
    from eviback.teacher.workflow import gold_in_evidence as saw_gold
    from eviback.types import Trajectory, from_dict

    return float(saw_gold(from_dict(Trajectory, record["trajectory"])))


def items(path: Path, prefix: str) -> dict[tuple[str, str], dict]:
    records = {(prefix + str(r["benchmark"]), str(r["id"])): r for r in read_jsonl(path)
               if "benchmark" in r and "id" in r}
    for r in records.values():
        r["gold_in_evidence"] = gold_in_evidence(r)
    return records


def macro(records: dict, keys: list) -> dict[str, float]:
    by: dict[str, list[dict]] = {}
    for k in keys:
        by.setdefault(k[0], []).append(records[k])
    return {m: sum(sum(float(r[m]) for r in rs) / len(rs) for rs in by.values()) / len(by) for m in METRICS}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dirs", nargs="+", type=Path, help="before and after eval directories, in pairs")
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if len(args.dirs) % 2:
        parser.error("give the eval directories in (before, after) pairs")
    before, after = {}, {}
    try:
        files = [items_path(directory) for directory in args.dirs]
    except FileNotFoundError as e:
        raise SystemExit(str(e)) from None
    names = [set(r["benchmark"] for r in read_jsonl(f)) for f in files[::2]]
    shared = len(names) > 1 and bool(set.intersection(*names))
    for i in range(0, len(args.dirs), 2):
        prefix = f"{i // 2}:" if shared else ""
        before.update(items(files[i], prefix))
        after.update(items(files[i + 1], prefix))
    keys = sorted(set(before) & set(after))
    if not keys:
        raise SystemExit("the two sides share no item: evaluate both policies on the same questions")
    report: dict = {"command": "python benchmarks/compare_evals.py " + " ".join(argv if argv is not None
                                                                               else sys.argv[1:]),
                    "items": len(keys), "only_one_side": len(set(before) ^ set(after)),
                    "before": macro(before, keys), "after": macro(after, keys),
                    "answers_differ": sum(normalize_answer(str(before[k].get("answer") or ""))
                                          != normalize_answer(str(after[k].get("answer") or "")) for k in keys),
                    "macro": {}, "by_benchmark": {}}
    for m in METRICS:
        report["macro"][m] = paired_bootstrap({k: float(before[k][m]) for k in keys},
                                              {k: float(after[k][m]) for k in keys},
                                              samples=args.samples, seed=args.seed).to_json()
    both = [k for k in keys if before[k]["gold_in_evidence"] and after[k]["gold_in_evidence"]]
    report["answering"] = {
        "items": len(both), "before": macro(before, both)["f1"], "after": macro(after, both)["f1"],
        "f1": paired_bootstrap({k: float(before[k]["f1"]) for k in both}, {k: float(after[k]["f1"]) for k in both},
                               samples=args.samples, seed=args.seed).to_json()} if both else None
    for bench in sorted({k[0] for k in keys}):
        mine = [k for k in keys if k[0] == bench]
        report["by_benchmark"][bench] = {
            "items": len(mine), "before": macro(before, mine), "after": macro(after, mine),
            "f1": paired_bootstrap({k: float(before[k]["f1"]) for k in mine}, {k: float(after[k]["f1"]) for k in mine},
                                   samples=args.samples, seed=args.seed).to_json()}
    print(f"{len(keys)} items, {report['answers_differ']} answers differ")
    print("| metric | before | after | after - before [95%] |\n|---|---|---|---|")
    for m in METRICS:
        d = report["macro"][m]
        print(f"| {m} | {report['before'][m]:.3f} | {report['after'][m]:.3f} | "
              f"{d['diff']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}] |")
    if report["answering"]:
        a, d = report["answering"], report["answering"]["f1"]
        print(f"| f1 where both saw a gold answer ({a['items']}) | {a['before']:.3f} | {a['after']:.3f} | "
              f"{d['diff']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}] |")
    for bench, row in report["by_benchmark"].items():
        d = row["f1"]
        print(f"| f1 {bench} ({row['items']}) | {row['before']['f1']:.3f} | {row['after']['f1']:.3f} | "
              f"{d['diff']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}] |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
