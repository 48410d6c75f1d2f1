"""The records of one training step, for the run's logs: what the rollouts, the backoff and the teacher did.

:class:`StepOutcome` is what the trainer hands to the run's step log after scoring a step's rollouts;
:func:`step_metrics` turns it into the step's namespaced metrics (one metrics.jsonl line, with TRL's loss
figures merged in by :mod:`eviback.train.step_log`), :func:`group_records` into one record per group
(rollouts/, groups.jsonl). Pure functions over records: no torch, no TRL.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from eviback.backoff import BackoffConfig, GroupAdvantages, GroupKind, has_verified_hit, summarize
from eviback.rollout import RolloutBatch
from eviback.teacher.labels import trajectory_label
from eviback.train.diversity import diversity_metrics, group_diversity
from eviback.types import Status, Verdict, to_dict


@dataclass(frozen=True)
class StepOutcome:
    """Everything one rollout step produced, for the logs: the groups, their advantages, the verdicts of
    the fallback groups (None where the teacher was not asked), and where the time went."""

    step: int
    batch: RolloutBatch
    outcomes: tuple[GroupAdvantages, ...]
    verdicts: tuple[tuple[Verdict, ...] | None, ...]
    teacher_s: float
    sync_s: float
    update_skipped: bool = False  # no group of the step (on any process) was kept: no update, no optimiser step

    @functools.cached_property
    def labels(self) -> tuple[tuple[Status, ...], ...]:
        """The evidence label of every rollout, group by group (S/A/I of what the actor saw, computed from
        the gold by :func:`eviback.teacher.labels.trajectory_label`: a diagnostic, never a reward); computed
        once, for the gate counts, the diversity and the group records."""
        return tuple(tuple(trajectory_label(t) for t in g.trajectories) for g in self.batch.groups)


def merge_outcomes(outcomes: Sequence[StepOutcome]) -> StepOutcome:
    """The step of a multi-process run as one record: every process's groups in process order; the
    times are the slowest process's (the step waits for it)."""
    first = outcomes[0]
    if len(outcomes) == 1:
        return first
    batch = RolloutBatch(
        groups=tuple(g for o in outcomes for g in o.batch.groups),
        turns=max((o.batch for o in outcomes), key=lambda b: b.wall_s).turns,
        wall_s=max(o.batch.wall_s for o in outcomes),
    )
    return StepOutcome(
        step=first.step, batch=batch,
        outcomes=tuple(x for o in outcomes for x in o.outcomes),
        verdicts=tuple(v for o in outcomes for v in o.verdicts),
        teacher_s=max(o.teacher_s for o in outcomes),
        sync_s=max(o.sync_s for o in outcomes),
        update_skipped=first.update_skipped,  # decided for the whole run (a collective), so the same everywhere
    )


def update_tokens(outcome: StepOutcome) -> dict[str, int]:
    """The tokens the step's update computed on, over every process: each kept rollout's prompt and response
    (`train/update_tokens`, what a forward pass reads: with the parameter count, the step's FLOPs) and its
    model tokens (`train/scored_tokens`, the positions the loss scores). 0 when the step ran no update."""
    total = scored = 0
    if not outcome.update_skipped:
        for group, advantages in zip(outcome.batch.groups, outcome.outcomes, strict=True):
            if not advantages.keep:
                continue
            for trajectory in group.trajectories:
                if trajectory.tokens is not None:
                    total += len(trajectory.tokens.prompt_ids) + len(trajectory.tokens.ids)
                    scored += sum(trajectory.tokens.mask)
    return {"train/update_tokens": total, "train/scored_tokens": scored}


def step_metrics(outcome: StepOutcome, backoff: BackoffConfig) -> dict[str, Any]:
    """The namespaced metrics of one step (rollouts, groups, teacher, time)."""
    batch = outcome.batch
    m = batch.metrics()
    s = summarize(outcome.outcomes, backoff)
    judged = [v for vs in outcome.verdicts if vs for v in vs]
    statuses = [v.status for v in judged if not v.teacher_error]
    record: dict[str, Any] = {
        "step": outcome.step,
        "rollout/em": m.em, "rollout/f1": m.f1, "rollout/sub_em": m.sub_em,
        "rollout/valid_answer_rate": m.valid_answer_rate, "rollout/avg_searches": m.avg_searches,
        "rollout/duplicate_query_rate": m.duplicate_query_rate,
        "rollout/forced_termination_rate": m.forced_termination_rate,
        "rollout/trajectories": m.n, "rollout/generated_tokens": batch.generated_tokens,
        "backoff/groups": s.groups, "backoff/verified_share": s.verified / s.groups if s.groups else 0.0,
        "backoff/all_zero_share": s.all_zero_share, "backoff/fallback_share": s.fallback_share,
        "backoff/fallback_groups": s.fallback, "backoff/informative_fallback_groups": s.informative_fallback,
        "backoff/informative_fallback_share": s.informative_fallback_share,
        "backoff/teacher_error_groups": s.teacher_error,
        "backoff/teacher_error_share": s.teacher_error / s.groups if s.groups else 0.0,
        "backoff/dropped_groups": s.dropped,
        "teacher/judged": len(judged),
        "teacher/calls": sum(v.calls for v in judged),
        "teacher/errors": sum(v.teacher_error for v in judged),
        "teacher/prompt_tokens": sum(v.prompt_tokens for v in judged),
        "teacher/completion_tokens": sum(v.completion_tokens for v in judged),
        "teacher/cache_hits": sum(v.cache_hits for v in judged),
        "teacher/latency_s": sum(v.latency_s for v in judged),
        "teacher/stage_b_runs": sum(v.stage_b_ran for v in judged),
        "teacher/stage_b_ungrounded": sum(v.ungrounded for v in judged),
        "time/rollout": batch.wall_s - batch.retrieve_s,
        "time/retrieval": batch.retrieve_s,
        "time/teacher": outcome.teacher_s,
        "time/weight_sync": outcome.sync_s,
        "train/update_skipped": outcome.update_skipped,
        **update_tokens(outcome),
    }
    for status in Status:
        record[f"teacher/status_{status.value}"] = sum(st is status for st in statuses)
    record.update(gate_counts(outcome))
    rewards = [r for o in outcome.outcomes if o.kind is GroupKind.FALLBACK for r in o.rewards]
    record["backoff/fallback_reward_mean"] = sum(rewards) / len(rewards) if rewards else None
    judged_rewards = [r for o, vs in zip(outcome.outcomes, outcome.verdicts, strict=True)
                      if o.kind is GroupKind.FALLBACK and vs for r in o.rewards]
    record["teacher/reward_mean"] = sum(judged_rewards) / len(judged_rewards) if judged_rewards else None
    # could the all-zero groups carry a signal? distinct queries, evidence sets, rewards, statuses per group
    record.update(diversity_metrics([
        group_diversity(g, o.rewards, vs, labels)
        for g, o, vs, labels in zip(batch.groups, outcome.outcomes, outcome.verdicts, outcome.labels, strict=True)
        if not has_verified_hit(o.em, backoff)]))
    return record


def gate_counts(outcome: StepOutcome) -> dict[str, int]:
    """Stage A as a gate, against the evidence labels of the rollouts it judged (computed from the gold; a
    diagnostic, never a reward): `teacher/gate_label_i` rollouts whose evidence is I, of which
    `teacher/gate_closed_on_i` Stage A called I; `teacher/gate_label_open` rollouts whose evidence is S or A,
    of which `teacher/gate_open_on_open` Stage A let through. Summed over a run, the gate's balanced
    accuracy is the mean of the two rates (a step holds too few rollouts for a rate of its own)."""
    counts = {"teacher/gate_label_i": 0, "teacher/gate_closed_on_i": 0, "teacher/gate_label_open": 0,
              "teacher/gate_open_on_open": 0}
    for labels, verdicts in zip(outcome.labels, outcome.verdicts, strict=True):
        for label, v in zip(labels, verdicts or (), strict=False):
            if v.teacher_error or v.stage_a_status is None:
                continue
            closed = v.stage_a_status is Status.INSUFFICIENT
            if label is Status.INSUFFICIENT:
                counts["teacher/gate_label_i"] += 1
                counts["teacher/gate_closed_on_i"] += closed
            else:
                counts["teacher/gate_label_open"] += 1
                counts["teacher/gate_open_on_open"] += not closed
    return counts


def group_records(outcome: StepOutcome) -> list[dict[str, Any]]:
    """One record per group with its whole rollouts (without token ids): EM, verdicts, rewards, advantages,
    how the group was treated. These go to `rollouts/step-<step>.jsonl.gz` (the last few steps only);
    :func:`compact_group_record` of each goes to `groups.jsonl`."""
    records = []
    for group, o, verdicts, labels in zip(outcome.batch.groups, outcome.outcomes, outcome.verdicts, outcome.labels,
                                          strict=True):
        records.append({
            "step": outcome.step,
            "question_id": group.question.id,
            "question": group.question.question,
            "golden_answers": list(group.question.golden_answers),
            "kind": o.kind.value,
            "fallback": o.kind is GroupKind.FALLBACK,
            "em": list(o.em),
            "rewards": list(o.rewards),
            "advantages": list(o.advantages),
            "keep": o.keep,
            "verdicts": [to_dict(v) for v in verdicts] if verdicts else None,
            "labels": [label.value for label in labels],  # the evidence labels (a diagnostic)
            "rollouts": [to_dict(dataclasses.replace(t, tokens=None)) for t in group.trajectories],
        })
    return records


def compact_group_record(record: dict[str, Any]) -> dict[str, Any]:
    """A group record without texts: per rollout its answer, queries, retrieved passage ids and stop
    reason (a few hundred bytes per rollout instead of several kB of passages and model text)."""
    compact = {k: v for k, v in record.items() if k != "rollouts"}
    compact["summaries"] = [{
        "answer": r["answer"],
        "stop_reason": r["stop_reason"],
        "queries": [t["action"]["content"] for t in r["turns"] if t["executed"]],
        "passage_ids": [[p["id"] for p in t["passages"]] for t in r["turns"] if t["executed"]],
        "turns": len(r["turns"]),
    } for r in record["rollouts"]]
    return compact
