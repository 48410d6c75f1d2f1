"""The statistics of an experiment: item-paired differences between arms with bootstrap intervals, and the
per-step training curves averaged over seeds. Pure functions over records; nothing here reads a file.

The bootstrap resamples what varies between two repetitions of the experiment: the evaluation items
(within each benchmark, so that every set keeps its size and the macro average its weights) and the seeds.
Both arms are scored on the same resampled items, which is what makes the difference paired: item
difficulty cancels, and the interval measures what is left. Seeds pair the same way when both arms ran the
same ones (run `seed: s` of every arm draws the same questions with the same sampling seeds, so two arms'
runs of one seed share their path until their updates differ): one resampled seed picks both arms' runs.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from eviback.metrics import f1_score, normalize_answer
from eviback.teacher.labels import gate_balanced_accuracy

# per-item metrics of an evaluation record (eval/items.jsonl): the ones the paired differences are about
# (`duplicate_searches`: executed searches that repeat an earlier query of the rollout; `forced`: cut at the
# turn limit)
ITEM_METRICS = ("f1", "em", "valid_answer", "searches", "duplicate_searches", "forced")
Key = tuple[str, str]  # (benchmark, question id)
RunItems = Mapping[Key, Mapping[str, float]]

# what the all-zero groups' diversity counts (train/diversity.py: `backoff/all_zero_distinct_<kind>`)
DIVERSITY_KINDS = ("queries", "evidence", "labels", "rewards", "statuses")

# per-step training metrics drawn side by side (metrics.jsonl keys)
CURVES = (
    ("backoff/all_zero_share", "all-zero share"),
    ("backoff/informative_fallback_share", "informative fallback share"),
    # within-group diversity of the all-zero groups (train/diversity.py): what a fallback reward could tell apart
    ("backoff/all_zero_distinct_evidence", "all-zero groups: distinct evidence sets"),
    ("backoff/all_zero_distinct_labels", "all-zero groups: distinct evidence labels"),
    ("backoff/all_zero_distinct_rewards", "all-zero groups: distinct rewards"),
    ("rollout/f1", "training rollouts: F1"),
    ("rollout/avg_searches", "training rollouts: searches"),
    ("time/teacher", "teacher seconds per step"),
    ("time/step", "step seconds"),
)


def item_scores(records: Sequence[Mapping[str, Any]]) -> dict[Key, dict[str, float]]:
    """Per (benchmark, id), the item metrics of one evaluation's records."""
    return {(r["benchmark"], str(r["id"])): {m: float(r[m]) for m in ITEM_METRICS} for r in records}


def changed_share(run: Mapping[Key, str | None], start: Mapping[Key, str | None]) -> float:
    """The share of items whose (normalised) final answer differs from the starting policy's: how far a run
    moved the greedy policy, whether or not the scores moved."""
    keys = [k for k in start if k in run]
    return sum(run[k] != start[k] for k in keys) / len(keys) if keys else float("nan")


@dataclass(frozen=True)
class Interval:
    """A difference (arm minus baseline) with its bootstrap percentile interval."""

    diff: float
    lo: float
    hi: float
    items: int

    @property
    def excludes_zero(self) -> bool:
        return self.lo > 0 or self.hi < 0

    def to_json(self) -> dict[str, Any]:
        return {"diff": self.diff, "lo": self.lo, "hi": self.hi, "items": self.items,
                "excludes_zero": self.excludes_zero}


def _matrix(runs: Sequence[RunItems], keys: Sequence[Key], metric: str) -> np.ndarray:
    return np.array([[run[k][metric] for k in keys] for run in runs], dtype=float)


def common_keys(*arms: Sequence[RunItems]) -> list[Key]:
    """The items every run was evaluated on; runs evaluated on different items cannot be paired."""
    runs = [run for arm in arms for run in arm]
    if not runs:
        raise ValueError("no runs to compare")
    first = set(runs[0])
    for run in runs[1:]:
        if set(run) != first:
            missing = sorted(first ^ set(run))[:3]
            raise ValueError(f"the runs were evaluated on different items (e.g. {missing}); evaluate every arm "
                             "on the same held-out questions")
    return sorted(first)


def paired_bootstrap(arm: Sequence[RunItems], base: Sequence[RunItems], metric: str, *, samples: int = 2000,
                     seed: int = 0, paired_seeds: bool = False) -> dict[str, Interval]:
    """Arm minus baseline on `metric`, per benchmark and as the macro average over benchmarks ("macro"),
    each with a 95% percentile interval over `samples` resamples of items (within benchmarks) and seeds:
    with `paired_seeds`, run i of `arm` and run i of `base` are the same seed and are drawn together (the
    two lists must be as long); otherwise each arm's seeds are drawn on their own."""
    if paired_seeds and len(arm) != len(base):
        raise ValueError(f"paired seeds need as many runs in each arm, got {len(arm)} and {len(base)}")
    keys = common_keys(arm, base)
    a, b = _matrix(arm, keys, metric), _matrix(base, keys, metric)
    by_benchmark: dict[str, list[int]] = defaultdict(list)
    for i, (benchmark, _) in enumerate(keys):
        by_benchmark[benchmark].append(i)
    rng = np.random.default_rng(seed)
    # seeds resampled per replicate, then averaged: (samples, items) per arm
    a_seeds = rng.integers(0, len(a), (samples, len(a)))
    b_seeds = a_seeds if paired_seeds else rng.integers(0, len(b), (samples, len(b)))
    a_rep, b_rep = a[a_seeds].mean(axis=1), b[b_seeds].mean(axis=1)
    out: dict[str, Interval] = {}
    macro_rep = np.zeros(samples)
    macro_point = 0.0
    for benchmark, index in by_benchmark.items():
        index = np.asarray(index)
        picks = index[rng.integers(0, len(index), (samples, len(index)))]
        rep = (np.take_along_axis(a_rep, picks, axis=1) - np.take_along_axis(b_rep, picks, axis=1)).mean(axis=1)
        point = float(a[:, index].mean() - b[:, index].mean())
        out[benchmark] = _interval(point, rep, len(index))
        macro_rep += rep / len(by_benchmark)
        macro_point += point / len(by_benchmark)
    out["macro"] = _interval(macro_point, macro_rep, len(keys))
    return out


def _interval(point: float, replicates: np.ndarray, items: int) -> Interval:
    lo, hi = np.percentile(replicates, [2.5, 97.5])
    return Interval(point, float(lo), float(hi), items)


def mean_curves(runs: Sequence[Sequence[Mapping[str, Any]]], key: str) -> tuple[list[int], list[float]]:
    """Per step, the mean of `key` over the runs (seeds) that logged it at that step."""
    values: dict[int, list[float]] = defaultdict(list)
    for records in runs:
        for r in records:
            if r.get(key) is not None and not (isinstance(r[key], float) and math.isnan(r[key])):
                values[int(r["step"])].append(float(r[key]))
    steps = sorted(values)
    return steps, [sum(values[s]) / len(values[s]) for s in steps]


def trailing_mean(values: Sequence[float], window: int) -> list[float]:
    """Each value replaced by the mean of it and the `window - 1` before it (fewer at the start): per-step
    curves of a few questions each are mostly noise, and this is what the eye should follow."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _nan_for_none(x: float | None) -> float:
    return float("nan") if x is None else x


def training_summary(runs: Sequence[Sequence[Mapping[str, Any]]]) -> dict[str, float]:
    """Means over the steps of every seed of one arm: what training cost and what the teacher did."""
    records = [r for run in runs for r in run]

    def mean(key: str) -> float:
        vals = [float(r[key]) for r in records if r.get(key) is not None]
        return sum(vals) / len(vals) if vals else float("nan")

    fallback = sum(r.get("backoff/fallback_groups", 0) for r in records)
    informative = sum(r.get("backoff/informative_fallback_groups", 0) for r in records)
    gate = {k: sum(r.get(f"teacher/gate_{k}", 0) for r in records)
            for k in ("label_i", "closed_on_i", "label_open", "open_on_open")}
    return {
        "runs": len(runs), "steps": max((len(run) for run in runs), default=0),
        "step_s": mean("time/step"), "rollout_s": mean("time/rollout"), "teacher_s": mean("time/teacher"),
        "update_s": mean("time/update"), "peak_rss_gb": max((float(r.get("memory/peak_rss_gb") or 0)
                                                             for r in records), default=0.0),
        "train_f1": mean("rollout/f1"), "kl": mean("train/kl"), "all_zero_share": mean("backoff/all_zero_share"),
        "fallback_groups": fallback, "informative_fallback_groups": informative,
        "informative_fallback_share": informative / fallback if fallback else float("nan"),
        "teacher_judged": sum(r.get("teacher/judged", 0) for r in records),
        "teacher_errors": sum(r.get("teacher/errors", 0) for r in records),
        # what the teacher said: Stage B runs where Stage A did not say I; ungrounded: it lowered S to I
        "teacher_status": {st: sum(r.get(f"teacher/status_{st}", 0) for r in records) for st in ("S", "A", "I")},
        "stage_b_runs": sum(r.get("teacher/stage_b_runs", 0) for r in records),
        "stage_b_ungrounded": sum(r.get("teacher/stage_b_ungrounded", 0) for r in records),
        # Stage A as a gate against the evidence labels: I evidence closed, S/A evidence let through (NaN
        # without both kinds, or for runs logged before these counts existed)
        "gate_balanced_accuracy": _nan_for_none(gate_balanced_accuracy(**gate)),
        # of the rollouts Stage A judged, those whose evidence label is S or A (a gold answer or a supporting
        # passage in what the actor saw), and all with a label
        "evidence_open": gate["label_open"], "evidence_labelled": gate["label_i"] + gate["label_open"],
        # within-group diversity of the all-zero groups: mean distinct values per group (train/diversity.py)
        "distinct": {k: mean(f"backoff/all_zero_distinct_{k}") for k in DIVERSITY_KINDS},
        # the machine under the run (train/gauges.py; NaN for runs logged before these gauges existed)
        "cpu_s": mean("time/cpu"), "other_cpu_s": mean("host/other_cpu_s"), "steal_share": mean("host/steal_share"),
        "teacher_tokens_per_judged": (sum(r.get("teacher/prompt_tokens", 0) + r.get("teacher/completion_tokens", 0)
                                          for r in records) / max(1, sum(r.get("teacher/judged", 0) for r in records))),
    }


def _all_zero(group: Mapping[str, Any]) -> bool:
    """A group record without a verified hit: any kind but "verified", except DAPO's, which drops the groups
    whose rollouts all hit as well as those that all failed (EM is 0 or 1)."""
    if group["kind"] == "dropped":
        return all(e < 1.0 for e in group["em"])
    return group["kind"] != "verified"


def all_zero_anatomy(groups: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """What could tell apart the rollouts of one arm's all-zero groups, counted from its compact group records
    (`groups.jsonl`: every group of every step; the all-zero ones are those without a verified hit):

    - `groups`, `rollouts`: the all-zero groups and their rollouts;
    - `informative`: groups whose rewards differ (advantages not all 0);
    - `first_query_is_question`: rollouts whose first search was the question as written (after answer
      normalisation: case, punctuation, articles); `no_search`: rollouts that never searched;
    - `same_evidence`: groups in which every rollout retrieved the same passage ids (over all its searches);
    - `f1_differs`: groups in which the rollouts' own answer F1 against the gold differs (what `f1-fallback`
      rewards);
    - `judged`, `judged_all_s`, `judged_all_a`, `judged_all_i`, `judged_mixed`: groups a teacher judged without
      an error, by whether it gave every rollout the same status;
    - `labelled`, `labels_differ`: groups whose records carry the rollouts' evidence labels (runs logged since
      they are kept), and those among them whose labels differ: all a perfect evidence judge could tell apart.
    """
    counts = dict.fromkeys(("groups", "rollouts", "informative", "first_query_is_question", "no_search",
                            "same_evidence", "f1_differs", "judged", "judged_all_s", "judged_all_a",
                            "judged_all_i", "judged_mixed", "labelled", "labels_differ"), 0)
    for group in groups:
        if not _all_zero(group):
            continue
        rollouts = group["summaries"]
        counts["groups"] += 1
        counts["rollouts"] += len(rollouts)
        counts["informative"] += len(set(group["rewards"])) > 1
        question = normalize_answer(group["question"])
        for r in rollouts:
            if not r["queries"]:
                counts["no_search"] += 1
            elif normalize_answer(r["queries"][0]) == question:
                counts["first_query_is_question"] += 1
        counts["same_evidence"] += len({frozenset(pid for ids in r["passage_ids"] for pid in ids)
                                        for r in rollouts}) == 1
        counts["f1_differs"] += len({f1_score(r["answer"], group["golden_answers"]) for r in rollouts}) > 1
        if group.get("labels"):
            counts["labelled"] += 1
            counts["labels_differ"] += len(set(group["labels"])) > 1
        verdicts = group.get("verdicts")
        if verdicts and not any(v.get("error") for v in verdicts):
            counts["judged"] += 1
            statuses = {v["status"] for v in verdicts}
            counts["judged_mixed" if len(statuses) > 1 else f"judged_all_{next(iter(statuses)).lower()}"] += 1
    return counts
