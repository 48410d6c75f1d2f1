"""Within-group diversity of the all-zero groups: could a group carry a learning signal at all?

A fallback reward (the teacher's, or the actor's F1) can only tell apart rollouts that differ. For each group
without a verified hit, :func:`group_diversity` counts how many different values its G rollouts have of:

- `queries`: the set of normalised queries a rollout executed (no search at all is one value: the empty set);
- `evidence`: the set of passages a rollout *saw* (the ids whose header survived the observation cut:
  ``eviback.teacher.workflow.evidence_as_seen``);
- `rewards`: the reward its advantage was computed from (the teacher's hybrid reward, the F1 of
  `f1-fallback`, or EM 0 without a fallback);
- `labels`: the evidence label of what a rollout saw (S/A/I, computed from the gold by
  ``eviback.teacher.labels``: a diagnostic, never a reward): the variation a perfect evidence judge could see;
- `statuses`: the teacher's final status (only for a group judged without error; else None).

1 means every rollout of the group is alike in that respect; G, that all differ. A run whose all-zero groups
have several evidence sets but one reward has signal its teacher does not see. :func:`diversity_metrics`
averages the counts over a step's all-zero groups, for the step metrics.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from eviback.metrics import normalize_answer
from eviback.teacher.labels import trajectory_label
from eviback.teacher.workflow import evidence_as_seen
from eviback.types import Group, Status, Verdict


@dataclass(frozen=True)
class GroupDiversity:
    """Distinct values among one group's rollouts (each count is between 1 and `rollouts`)."""

    rollouts: int
    queries: int
    evidence: int
    rewards: int
    statuses: int | None = None  # None: the group was not judged, or a verdict is a teacher error
    labels: int = 1


def group_diversity(
    group: Group, rewards: Sequence[float], verdicts: Sequence[Verdict] | None = None,
    labels: Sequence[Status] | None = None,
) -> GroupDiversity:
    """The diversity of `group`; `rewards` (one per rollout) are those its advantages came from, `verdicts`
    the teacher's when it was judged, `labels` the rollouts' evidence labels where the caller has them (else
    computed here)."""
    if len(rewards) != len(group.trajectories):
        raise ValueError(f"{len(rewards)} rewards for a group of {len(group.trajectories)} rollouts")
    if labels is None:
        labels = [trajectory_label(t) for t in group.trajectories]

    queries = {frozenset(normalize_answer(q) for q in t.queries) for t in group.trajectories}
    evidence = set()
    for t in group.trajectories:
        seen = evidence_as_seen(t)
        # a result without passage ids (a retriever that gives none) is told apart by its text
        evidence.add(frozenset(pid for e in seen for pid in e.passage_ids)
                     | frozenset(e.text for e in seen if not e.passage_ids))
    statuses = None
    if verdicts and not any(v.teacher_error for v in verdicts):
        statuses = len({v.status for v in verdicts})
    return GroupDiversity(rollouts=len(group.trajectories), queries=len(queries), evidence=len(evidence),
                          rewards=len(set(rewards)), statuses=statuses,
                          labels=len(set(labels)))


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def diversity_metrics(diversities: Sequence[GroupDiversity]) -> dict[str, Any]:
    """The step metrics of the all-zero groups' diversities: mean distinct values per group (None without
    such a group; statuses over the judged groups only)."""
    judged = [d.statuses for d in diversities if d.statuses is not None]
    return {
        "backoff/all_zero_distinct_queries": _mean([d.queries for d in diversities]),
        "backoff/all_zero_distinct_evidence": _mean([d.evidence for d in diversities]),
        "backoff/all_zero_distinct_rewards": _mean([d.rewards for d in diversities]),
        "backoff/all_zero_distinct_labels": _mean([d.labels for d in diversities]),
        "backoff/all_zero_distinct_statuses": _mean(judged),
    }
