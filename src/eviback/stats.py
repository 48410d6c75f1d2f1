"""Paired bootstrap intervals for one policy against another on the same evaluation items (pure, seeded).

    from eviback.stats import paired_bootstrap
    interval = paired_bootstrap(before={("nq", "q1"): 0.0, ...}, after={("nq", "q1"): 1.0, ...})
    interval.diff, interval.lo, interval.hi, interval.includes_zero

A run's report compares its trained policy with its starting policy on the held-out questions both answered.
The interval is over what would change if the evaluation were repeated on other questions of the same
benchmarks: items are resampled with replacement *within* each benchmark (each keeps its size, so the macro
average keeps its weights), and both policies are scored on the same resampled items, which is what makes
the difference paired (item difficulty cancels). The experiments' comparison (eviback.experiment.compare)
resamples seeds as well; with one run per arm it reduces to this.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

Key = tuple[str, str]  # (benchmark, question id)


@dataclass(frozen=True)
class PairedInterval:
    """`after - before`, macro-averaged over benchmarks, with its bootstrap percentile interval."""

    diff: float
    lo: float
    hi: float
    items: int  # the items both policies answered (the pairs)
    benchmarks: int
    samples: int
    seed: int
    confidence: float

    @property
    def includes_zero(self) -> bool:
        """No change is among the differences the items allow: the data do not tell this difference from noise."""
        return self.lo <= 0.0 <= self.hi

    def to_json(self) -> dict[str, float | int | bool]:
        return {"diff": self.diff, "lo": self.lo, "hi": self.hi, "items": self.items, "benchmarks": self.benchmarks,
                "samples": self.samples, "seed": self.seed, "confidence": self.confidence,
                "includes_zero": self.includes_zero}


def paired_bootstrap(before: Mapping[Key, float], after: Mapping[Key, float], *, samples: int = 2000, seed: int = 0,
                     confidence: float = 0.95) -> PairedInterval:
    """The macro average over benchmarks of `after - before` on the items both hold, and its `confidence`
    percentile interval over `samples` resamples of the items within each benchmark (fixed `seed`: the same
    inputs give the same interval). Keys are (benchmark, item id); items only one side holds are left out."""
    if samples < 100:
        raise ValueError(f"samples must be >= 100 for a percentile interval, got {samples}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    keys = sorted(set(before) & set(after))
    if not keys:
        raise ValueError("the two evaluations share no item: evaluate both policies on the same questions")
    by_benchmark: dict[str, list[float]] = defaultdict(list)
    for key in keys:
        by_benchmark[key[0]].append(float(after[key]) - float(before[key]))
    rng = np.random.default_rng(seed)
    point = 0.0
    replicates = np.zeros(samples)
    for _, diffs in sorted(by_benchmark.items()):
        d = np.asarray(diffs)
        point += float(d.mean()) / len(by_benchmark)
        replicates += d[rng.integers(0, len(d), (samples, len(d)))].mean(axis=1) / len(by_benchmark)
    tail = (1 - confidence) / 2 * 100
    lo, hi = np.percentile(replicates, [tail, 100 - tail])
    return PairedInterval(diff=point, lo=float(lo), hi=float(hi), items=len(keys), benchmarks=len(by_benchmark),
                          samples=samples, seed=seed, confidence=confidence)
