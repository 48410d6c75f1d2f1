"""E2E-APE statistics on hand-computed cases: Wilson lower bounds, Fleiss' kappa, bootstrap lower bounds."""

import pytest

from eviback.ape.records import RateEstimate
from eviback.ape.stats import (
    bootstrap_lower_bound,
    fleiss_kappa,
    one_sided_z,
    wilson_lower_bound,
)


def test_wilson_lower_bound_by_hand():
    # z = 1.6449 (one-sided 95%); p = 0.8, n = 10:
    # (0.8 + z^2/20 - z*sqrt(0.016 + z^2/400)) / (1 + z^2/10) = (0.93528 - 0.24818) / 1.27055 = 0.5408
    assert one_sided_z(0.95) == pytest.approx(1.64485, abs=1e-4)
    assert wilson_lower_bound(8, 10, 0.95) == pytest.approx(0.5408, abs=1e-3)
    # 10/10 is not certainty on ten rollouts: (1 + z^2/20 - z^2/20) / (1 + z^2/10) = 1 / 1.27055
    assert wilson_lower_bound(10, 10, 0.95) == pytest.approx(1 / 1.27055, abs=1e-4)
    assert wilson_lower_bound(0, 10, 0.95) == 0.0
    assert wilson_lower_bound(0, 0) == 0.0  # no evidence of agreement
    assert wilson_lower_bound(90, 100) > wilson_lower_bound(9, 10)  # more rollouts, tighter bound
    assert wilson_lower_bound(8, 10, 0.99) < wilson_lower_bound(8, 10, 0.9)
    with pytest.raises(ValueError):
        wilson_lower_bound(11, 10)
    with pytest.raises(ValueError, match="confidence"):
        wilson_lower_bound(1, 2, confidence=1.0)
    rate = RateEstimate.of(8, 10, 0.95)
    assert rate.rate == 0.8 and rate.lower == pytest.approx(0.5408, abs=1e-3)


def test_fleiss_kappa_wikipedia_example():
    # The worked example of Fleiss' kappa (10 subjects, 14 raters, 5 categories): kappa = 0.210
    table = [[0, 0, 0, 0, 14], [0, 2, 6, 4, 2], [0, 0, 3, 5, 6], [0, 3, 9, 2, 0], [2, 2, 8, 1, 1],
             [7, 7, 0, 0, 0], [3, 2, 6, 3, 0], [2, 5, 3, 2, 2], [6, 5, 2, 1, 0], [0, 2, 2, 3, 7]]
    assert fleiss_kappa(table) == pytest.approx(0.210, abs=1e-3)


def test_fleiss_kappa_two_raters_by_hand():
    # (S,S) (I,I) (S,I) (I,I): p_S = 3/8, p_I = 5/8, Pe = 34/64, P = 3/4 -> (0.75 - 0.53125) / 0.46875 = 0.4667
    assert fleiss_kappa([[2, 0], [0, 2], [1, 1], [0, 2]]) == pytest.approx(0.21875 / 0.46875)
    assert fleiss_kappa([[2, 0], [0, 2]]) == pytest.approx(1.0)  # perfect agreement, two labels used
    assert fleiss_kappa([[1, 1], [1, 1]]) == pytest.approx(-1.0)  # systematic disagreement


def test_fleiss_kappa_undefined_for_a_constant_rater():
    assert fleiss_kappa([[3, 0, 0], [3, 0, 0]]) is None  # every rating in one category: no information
    assert fleiss_kappa([]) is None
    with pytest.raises(ValueError, match="same number"):
        fleiss_kappa([[2, 0], [1, 0]])


def test_bootstrap_lower_bound_is_seeded_and_below_the_estimate():
    table = [[2, 0]] * 12 + [[0, 2]] * 12 + [[1, 1]] * 4
    value = fleiss_kappa(table)
    lower = bootstrap_lower_bound(table, fleiss_kappa, confidence=0.95, resamples=500, seed=3)
    assert lower is not None and lower < value
    assert lower == bootstrap_lower_bound(table, fleiss_kappa, confidence=0.95, resamples=500, seed=3)
    assert bootstrap_lower_bound([[3, 0]] * 5, fleiss_kappa) is None  # undefined on the items themselves
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    assert bootstrap_lower_bound([1.0] * 10, mean, resamples=100) == 1.0


def test_wilson_lower_bound_is_scipys_wilson_interval_one_sided():
    from scipy.stats import binomtest
    for k, n in [(0, 1), (3, 10), (8, 10), (10, 10), (40, 81)]:
        two_sided_90 = binomtest(k, n).proportion_ci(confidence_level=0.90, method="wilson")
        assert wilson_lower_bound(k, n, 0.95) == pytest.approx(max(0.0, two_sided_90.low), abs=1e-12)
    assert wilson_lower_bound(5, 10, 0.5) == pytest.approx(0.5)  # the median bound is the estimate


def test_bootstrap_lower_bound_is_a_one_sided_percentile_bound():
    import numpy as np
    from scipy.stats import bootstrap
    xs = [1.0] * 60 + [0.0] * 40
    mean = lambda v: sum(v) / len(v)  # noqa: E731
    lower = bootstrap_lower_bound(xs, mean, confidence=0.95, resamples=2000, seed=7)
    # scipy's one-sided percentile bound of the same resamples (index resampling, same generator)
    ref = bootstrap((np.arange(100),), lambda i: float(np.asarray(xs)[i].mean()), n_resamples=2000,
                    vectorized=False, confidence_level=0.95, alternative="greater", method="percentile",
                    rng=np.random.default_rng(7)).confidence_interval.low
    assert lower == pytest.approx(ref)
    # and near the normal approximation p - z sqrt(p (1 - p) / n) = 0.6 - 1.645 x 0.049 = 0.519
    assert lower == pytest.approx(0.6 - 1.6449 * (0.24 / 100) ** 0.5, abs=0.02)
    assert bootstrap_lower_bound(xs, mean, confidence=0.8, seed=7) > lower
    assert bootstrap_lower_bound([0.7], mean) == 0.7  # one item: every resample is that item
