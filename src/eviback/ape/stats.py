"""The statistics E2E-APE's gates are judged on: confidence bounds, not point estimates.

- :func:`wilson_lower_bound`: the one-sided lower confidence bound of a binomial rate (Wilson score). With
  few rollouts a perfect 10/10 agreement is only ~0.79 at 95% confidence, so a gate "agreement >= 0.9"
  cannot be passed by luck on a tiny sample.
- :func:`fleiss_kappa`: chance-corrected agreement of `n` raters (here: teacher samples, or a verdict and its
  verdict under a perturbation) over items, from a table of counts `table[item][category]`.
- :func:`bootstrap_lower_bound`: a percentile-bootstrap lower bound of any statistic over items (resampling
  items with replacement, seeded), used for kappa.

Pure functions over numbers; no dependency beyond the standard library.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from statistics import NormalDist


def one_sided_z(confidence: float) -> float:
    """The standard-normal quantile of a one-sided bound at `confidence` (0.95 -> 1.645)."""
    if not 0.5 <= confidence < 1:
        raise ValueError(f"confidence={confidence} must be in [0.5, 1), e.g. 0.95")
    return NormalDist().inv_cdf(confidence)


def wilson_lower_bound(successes: int, n: int, confidence: float = 0.95) -> float:
    """One-sided lower confidence bound of the rate `successes / n` (Wilson score interval).

    `n == 0` gives 0.0: no evidence of agreement is no agreement."""
    if successes < 0 or n < 0 or successes > n:
        raise ValueError(f"need 0 <= successes <= n, got {successes}/{n}")
    if n == 0:
        return 0.0
    z = one_sided_z(confidence)
    p = successes / n
    centre = p + z * z / (2 * n)
    margin = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, (centre - margin) / (1 + z * z / n))


def fleiss_kappa(table: Sequence[Sequence[int]]) -> float | None:
    """Fleiss' kappa of a count table: `table[i][j]` raters put item i in category j.

    Every item must have the same number of raters (>= 2). Returns None when kappa is undefined: no items,
    or every rating in one category (expected agreement 1: a constant rater carries no information)."""
    if not table:
        return None
    raters = sum(table[0])
    if raters < 2:
        raise ValueError(f"fleiss_kappa needs >= 2 ratings per item, got {raters}")
    if any(sum(row) != raters for row in table):
        raise ValueError("fleiss_kappa needs the same number of ratings for every item")
    items = len(table)
    categories = len(table[0])
    totals = [sum(row[j] for row in table) for j in range(categories)]
    p_j = [t / (items * raters) for t in totals]
    expected = sum(p * p for p in p_j)
    if expected >= 1.0 - 1e-12:
        return None
    observed = sum((sum(c * c for c in row) - raters) / (raters * (raters - 1)) for row in table) / items
    return (observed - expected) / (1 - expected)


def bootstrap_lower_bound(
    items: Sequence,
    statistic: Callable[[Sequence], float | None],
    *,
    confidence: float = 0.95,
    resamples: int = 1000,
    seed: int = 0,
    undefined: float = 0.0,
) -> float | None:
    """Percentile-bootstrap lower bound of `statistic(items)` at `confidence`, resampling items with
    replacement `resamples` times (seeded: the same inputs give the same bound).

    Returns None when the statistic is undefined on the items themselves. A resample on which it is
    undefined counts as `undefined` (default 0: conservative, no agreement demonstrated)."""
    one_sided_z(confidence)  # validates confidence
    if resamples < 1:
        raise ValueError(f"resamples={resamples} must be >= 1")
    if not items or statistic(items) is None:
        return None
    rng = random.Random(seed)
    n = len(items)
    values = []
    for _ in range(resamples):
        sample = [items[rng.randrange(n)] for _ in range(n)]
        value = statistic(sample)
        values.append(undefined if value is None else value)
    values.sort()
    # the (1 - confidence) quantile, rounding toward the lower value (conservative)
    index = max(0, math.floor((1 - confidence) * resamples) - 1)
    return values[index]


@dataclass(frozen=True)
class RateEstimate:
    """A rate with its one-sided Wilson lower bound."""

    successes: int
    n: int
    rate: float | None  # None when n == 0
    lower: float  # Wilson lower bound at the spec's confidence (0.0 when n == 0)

    @classmethod
    def of(cls, successes: int, n: int, confidence: float) -> RateEstimate:
        return cls(successes, n, successes / n if n else None, wilson_lower_bound(successes, n, confidence))


@dataclass(frozen=True)
class KappaEstimate:
    """Fleiss' kappa with its bootstrap lower bound; None where undefined (e.g. a constant teacher)."""

    value: float | None
    lower: float | None
    items: int
    raters: int
    resamples: int
