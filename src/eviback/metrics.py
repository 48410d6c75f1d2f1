"""Answer metrics (EM, sub-EM, token F1) and trajectory statistics.

Answer normalisation exists once, here: SQuAD's rule (lower-case, drop punctuation, drop the articles
a/an/the, collapse white space). Every answer metric is the maximum over the gold answers, and a missing
answer (None) scores 0. F1 follows FlashRAG: when either side normalises to yes/no/noanswer and the two
differ, that pair scores 0.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from eviback.types import StopReason, Trajectory

_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_SPECIAL = frozenset({"yes", "no", "noanswer"})


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower-case, strip punctuation, drop a/an/the, collapse white space."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str | None, golds: Sequence[str]) -> float:
    """1.0 when the normalised prediction equals a normalised gold answer."""
    if prediction is None:
        return 0.0
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(g) for g in golds))


def sub_exact_match(prediction: str | None, golds: Sequence[str]) -> float:
    """1.0 when a normalised gold answer is a substring of the normalised prediction."""
    if prediction is None:
        return 0.0
    pred = normalize_answer(prediction)
    return float(any(normalize_answer(g) in pred for g in golds))


def f1_score(prediction: str | None, golds: Sequence[str]) -> float:
    """Token-level F1, max over gold answers (FlashRAG's yes/no/noanswer rule)."""
    if prediction is None:
        return 0.0
    pred = normalize_answer(prediction)
    best = 0.0
    for gold in golds:
        ref = normalize_answer(gold)
        if (pred in _SPECIAL or ref in _SPECIAL) and pred != ref:
            continue
        common = Counter(pred.split()) & Counter(ref.split())
        same = sum(common.values())
        if same == 0:
            continue
        precision = same / len(pred.split())
        recall = same / len(ref.split())
        best = max(best, 2 * precision * recall / (precision + recall))
    return best


@dataclass(frozen=True)
class AnswerScores:
    em: float
    f1: float
    sub_em: float


def score_answer(prediction: str | None, golds: Sequence[str]) -> AnswerScores:
    return AnswerScores(
        em=exact_match(prediction, golds),
        f1=f1_score(prediction, golds),
        sub_em=sub_exact_match(prediction, golds),
    )


@dataclass(frozen=True)
class TrajectoryStats:
    """Search-efficiency statistics of one rollout.

    `valid_answer`: the model's own text holds a parseable `<answer>` (observations and the invalid-action
    message never count). `searches`: executed searches. `duplicate_searches`: executed searches whose
    normalised query repeats an earlier one of the same rollout. `forced`: the engine ended the rollout
    (turn or length budget) before the model answered."""

    valid_answer: bool
    searches: int
    duplicate_searches: int
    forced: bool


def trajectory_stats(trajectory: Trajectory) -> TrajectoryStats:
    seen: set[str] = set()
    duplicates = 0
    for query in trajectory.queries:
        key = normalize_answer(query)
        duplicates += key in seen
        seen.add(key)
    return TrajectoryStats(
        valid_answer=trajectory.answer is not None,
        searches=len(trajectory.queries),
        duplicate_searches=duplicates,
        forced=trajectory.stop_reason in (StopReason.FORCED, StopReason.LENGTH),
    )


@dataclass(frozen=True)
class RolloutMetrics:
    """Means over a set of rollouts: the numbers every evaluation table and training step reports.

    `duplicate_query_rate` is duplicates / searches over the whole set (0 when nothing was searched)."""

    n: int
    em: float
    f1: float
    sub_em: float
    valid_answer_rate: float
    avg_searches: float
    duplicate_query_rate: float
    forced_termination_rate: float


def rollout_metrics(trajectories: Iterable[Trajectory]) -> RolloutMetrics:
    trajectories = list(trajectories)
    n = len(trajectories)
    if n == 0:
        return RolloutMetrics(0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    scores = [score_answer(t.answer, t.question.golden_answers) for t in trajectories]
    stats = [trajectory_stats(t) for t in trajectories]
    searches = sum(s.searches for s in stats)
    return RolloutMetrics(
        n=n,
        em=sum(s.em for s in scores) / n,
        f1=sum(s.f1 for s in scores) / n,
        sub_em=sum(s.sub_em for s in scores) / n,
        valid_answer_rate=sum(s.valid_answer for s in stats) / n,
        avg_searches=searches / n,
        duplicate_query_rate=sum(s.duplicate_searches for s in stats) / searches if searches else 0.0,
        forced_termination_rate=sum(s.forced for s in stats) / n,
    )
