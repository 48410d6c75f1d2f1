"""The precondition's shares for smaller groups, from the per-group records a precondition run wrote.

    python benchmarks/precondition_by_group_size.py results/precondition-builder4.groups.jsonl.gz

`bench_precondition.py` rolls out G rollouts per question; a group of k < G is any k of them. For each model
and each k, this averages over every k-subset of every group (exactly, no sampling): the share of all-zero
k-groups (no rollout with EM > 0) whose evidence labels differ, and whose teacher rewards differ (the
teacher is informative). Each subset's rewards are the ones the teacher gave in the G-group; the two-stage
teacher judges each rollout on its own evidence, so a subset's rewards are what it would have given the
subset; a subset holding a rollout the teacher failed on (reward None) counts as not informative, as
`bench_precondition.py` counts a whole group. Larger groups than G cannot be read off these records.
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
from math import comb


def shares(groups: list[dict], k: int) -> dict[str, float]:
    """Expected shares over all k-subsets of each group: all-zero among all k-groups; labels differ and
    informative among the all-zero ones."""
    all_zero = labels = informative = 0.0
    for group in groups:
        n = len(group["em"])
        weight = 1 / comb(n, k)
        for subset in itertools.combinations(range(n), k):
            if any(group["em"][i] > 0 for i in subset):
                continue
            all_zero += weight
            labels += weight * (len({group["labels"][i] for i in subset}) > 1)
            rewards = [group["rewards"][i] for i in subset]
            # as bench_precondition counts a group: one the teacher failed on (a reward None) is not informative
            informative += weight * (None not in rewards and len(set(rewards)) > 1)
    return {"all_zero": all_zero / len(groups), "labels_differ": labels / all_zero if all_zero else 0.0,
            "informative": informative / all_zero if all_zero else 0.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("groups", help="a precondition run's per-group records (.jsonl.gz)")
    args = parser.parse_args()
    with gzip.open(args.groups, "rt") as f:
        records = [json.loads(line) for line in f]
    for model in sorted({r["model"] for r in records}):
        groups = [r for r in records if r["model"] == model]
        sizes = range(2, min(len(g["em"]) for g in groups) + 1)
        table = {k: shares(groups, k) for k in sizes}
        print(f"\n{model} ({len(groups)} questions)\n")
        print("| G | " + " | ".join(str(k) for k in sizes) + " |")
        print("|---|" + "---:|" * len(sizes))
        for key, name in (("all_zero", "all-zero groups"), ("labels_differ", "all-zero: labels differ"),
                          ("informative", "all-zero: teacher informative")):
            print(f"| {name} | " + " | ".join(f"{table[k][key]:.3f}" for k in sizes) + " |")


if __name__ == "__main__":
    main()
