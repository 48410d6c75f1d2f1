"""The statistics E2E-APE's gates are judged on: confidence bounds, not point estimates.

- :func:`wilson_lower_bound`: the one-sided lower confidence bound of a binomial rate (Wilson score, from
  `scipy.stats.binomtest`). With few rollouts a perfect 10/10 agreement is only ~0.79 at 95% confidence, so
  a gate "agreement >= 0.9" cannot be passed by luck on a tiny sample.
- :func:`fleiss_kappa`: chance-corrected agreement of `n` raters (here: teacher samples, or a verdict and its
  verdict under a perturbation) over items, from a table of counts `table[item][category]`.
- :func:`bootstrap_lower_bound`: a one-sided percentile-bootstrap lower bound of any statistic over items
  (`scipy.stats.bootstrap`, resampling items with replacement, seeded), used for kappa and the objective.

Pure functions over numbers. The experiments' item-paired bootstrap (hierarchical: items and seeds) is
another computation and lives in :mod:`eviback.experiment.compare`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
from scipy import stats


def one_sided_z(confidence: float) -> float:
    """The standard-normal quantile of a one-sided bound at `confidence` (0.95 -> 1.645)."""
    if not 0.5 <= confidence < 1:
        raise ValueError(f"confidence={confidence} must be in [0.5, 1), e.g. 0.95")
    return float(stats.norm.ppf(confidence))


def wilson_lower_bound(successes: int, n: int, confidence: float = 0.95) -> float:
    """One-sided lower confidence bound of the rate `successes / n` (Wilson score interval).

    `n == 0` gives 0.0: no evidence of agreement is no agreement."""
    if successes < 0 or n < 0 or successes > n:
        raise ValueError(f"need 0 <= successes <= n, got {successes}/{n}")
    one_sided_z(confidence)  # validates confidence
    if n == 0:
        return 0.0
    # the one-sided bound at `confidence` is the lower end of the two-sided interval at 2 x confidence - 1
    interval = stats.binomtest(successes, n).proportion_ci(confidence_level=2 * confidence - 1, method="wilson")
    return max(0.0, float(interval.low))


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
    """One-sided percentile-bootstrap lower bound of `statistic(items)` at `confidence`: the `1 - confidence`
    quantile of the statistic over `resamples` resamples of the items with replacement
    (`scipy.stats.bootstrap`, seeded: the same inputs give the same bound).

    Returns None when the statistic is undefined on the items themselves. A resample on which it is
    undefined counts as `undefined` (default 0: conservative, no agreement demonstrated)."""
    one_sided_z(confidence)  # validates confidence
    if resamples < 1:
        raise ValueError(f"resamples={resamples} must be >= 1")
    if not items:
        return None
    value = statistic(items)
    if value is None:
        return None
    if len(items) == 1:  # every resample is the item itself
        return float(value)

    def on_resample(index: np.ndarray) -> float:
        resampled = statistic([items[i] for i in index])
        return undefined if resampled is None else resampled

    # the items are resampled by index, so a statistic may take any items (rows of a table, outcomes)
    result = stats.bootstrap((np.arange(len(items)),), on_resample, n_resamples=resamples, vectorized=False,
                             confidence_level=confidence, alternative="greater", method="percentile",
                             rng=np.random.default_rng(seed))
    return float(result.confidence_interval.low)
