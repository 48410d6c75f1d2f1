"""Confirm on the sealed test: the declared rule that decides whether the selected winner is frozen.

The selection is made on the validation split; the sealed test then either confirms it or not. Under
``freeze.rule: lower-bound-above-baseline`` the winner is frozen only when the percentile-bootstrap lower
bound of its objective on the test rollouts (resampling rollouts, at ``stability.confidence``) is above the
manual single-prompt policy's point estimate on the same rollouts (plus ``freeze.margin``), and, with
``freeze.require_test_gates``, every gate also holds for it there. Otherwise the run ends with nothing frozen
and :attr:`~eviback.ape.records.Confirmation.reasons` says why. Pure functions of logged outcomes: the
decision can be recomputed from the event log.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

from eviback.ape.measure import sufficiency_metrics
from eviback.ape.records import CandidateMetrics, Confirmation, GateReport, RolloutOutcome
from eviback.ape.spec import ConstraintSpec, ObjectiveMetric
from eviback.ape.stats import bootstrap_lower_bound


def objective_of(outcomes: Sequence[RolloutOutcome], labels: Mapping[str, bool | None],
                 spec: ConstraintSpec) -> float | None:
    s = sufficiency_metrics(outcomes, labels, spec.objective.ambiguous_credit)
    return s.balanced_agreement if spec.objective.metric is ObjectiveMetric.BALANCED_AGREEMENT else s.agreement


def objective_lower_bound(outcomes: Sequence[RolloutOutcome], labels: Mapping[str, bool | None],
                          spec: ConstraintSpec) -> float | None:
    """The one-sided bootstrap lower bound of the objective over the labelled verdicts (seeded by their keys,
    so the same outcomes always give the same bound)."""
    judged = sorted((o for o in outcomes if o.status is not None and labels.get(o.key) is not None),
                    key=lambda o: o.key)
    seed = int(hashlib.sha256("\n".join(o.key for o in judged).encode()).hexdigest()[:8], 16)
    return bootstrap_lower_bound(judged, lambda items: objective_of(items, labels, spec),
                                 confidence=spec.stability.confidence, resamples=spec.stability.bootstrap_resamples,
                                 seed=seed)


def confirm(winner: str, winner_outcomes: Sequence[RolloutOutcome], winner_report: GateReport, baseline: str,
            baseline_metrics: CandidateMetrics, labels: Mapping[str, bool | None],
            spec: ConstraintSpec) -> Confirmation:
    """Apply the spec's freeze rule to the winner's base verdicts on the sealed test."""
    rule = spec.freeze
    point = objective_of(winner_outcomes, labels, spec)
    lower = objective_lower_bound(winner_outcomes, labels, spec)
    base = baseline_metrics.objective(spec.objective.metric)
    reasons = []
    if spec.freeze.require_test_gates and not winner_report.passed:
        reasons += [f"sealed-test gate failed: {r}" for r in winner_report.reasons()]
    if lower is None:
        reasons.append("the winner has no labelled verdict on the sealed test: its objective is undefined")
    elif base is None:
        reasons.append("the baseline has no labelled verdict on the sealed test: nothing to compare with")
    elif not lower > base + rule.margin:
        reasons.append(f"the winner's objective lower bound {lower:.3f} (estimate {point:.3f}) is not above the "
                       f"single-prompt baseline's {base:.3f}" + (f" + margin {rule.margin:g}" if rule.margin else ""))
    return Confirmation(rule.rule, not reasons, winner, baseline, point, lower, base, rule.margin, tuple(reasons))
