"""Feedback on training rollouts: a candidate's score there (acceptance) and its failures, shown to the
controller in gold-free form."""

from __future__ import annotations

import hashlib

from eviback.ape.context import StageContext
from eviback.ape.controller import FailureExample, ParentSummary
from eviback.ape.events import FeedbackScored
from eviback.ape.measure import sufficiency_metrics
from eviback.ape.records import Candidate, Condition, ConditionResult, Split
from eviback.ape.rollouts import Rollout, subset
from eviback.ape.spec import ObjectiveMetric
from eviback.teacher.workflow import blind_view
from eviback.types import Status


def feedback_rollouts(ctx: StageContext) -> tuple[Rollout, ...]:
    labelled = [r for r in ctx.splits.train if r.sufficient is not None] or list(ctx.splits.train)
    return subset(labelled, ctx.spec.data.feedback_rollouts, ctx.spec.data.salt + ":feedback")


def feedback_result(ctx: StageContext, c: Candidate) -> ConditionResult:
    result = ctx.judging.judged(c, Split.TRAIN, feedback_rollouts(ctx), Condition.BASE)
    if c.id not in ctx.state.feedback:
        s = sufficiency_metrics(result.outcomes, ctx.labels, ctx.spec.objective.ambiguous_credit)
        balanced = ctx.spec.objective.metric is ObjectiveMetric.BALANCED_AGREEMENT
        ctx.emit(FeedbackScored(c.id, s.balanced_agreement if balanced else s.agreement))
    return result


def feedback_score(ctx: StageContext, c: Candidate) -> float | None:
    feedback_result(ctx, c)
    return ctx.state.feedback[c.id].objective


def failures_of(ctx: StageContext, c: Candidate, round_: int) -> tuple[ParentSummary, list[FailureExample]]:
    result = feedback_result(ctx, c)
    by_key = {r.key: r for r in ctx.splits.train}
    wrong = []
    for o in result.outcomes:
        label = ctx.labels.get(o.key)
        if o.status is None or label is None:
            continue
        if (o.status is Status.SUFFICIENT) != label or o.status is Status.AMBIGUOUS:
            wrong.append(o)
    # a different handful each round, deterministically
    wrong.sort(key=lambda o: hashlib.sha256(f"{round_}:{o.key}".encode()).hexdigest())
    examples = [FailureExample.of(blind_view(by_key[o.key].trajectory), o.status, bool(ctx.labels[o.key]))
                for o in wrong[: ctx.spec.search.failures_shown] if o.status is not None]
    s = sufficiency_metrics(result.outcomes, ctx.labels, ctx.spec.objective.ambiguous_credit)
    counts = {k: sum(o.status is not None and o.status.value == k for o in result.outcomes) for k in "SAI"}
    summary = ParentSummary(
        rollouts=len(result.outcomes), labelled=s.labelled, balanced_agreement=s.balanced_agreement,
        said_s_on_insufficient=sum(o.status is Status.SUFFICIENT and ctx.labels.get(o.key) is False
                                   for o in result.outcomes),
        said_i_on_sufficient=sum(o.status is Status.INSUFFICIENT and ctx.labels.get(o.key) is True
                                 for o in result.outcomes),
        status_counts=tuple(counts.items()))
    return summary, examples
