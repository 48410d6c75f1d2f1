"""Answer metrics (EM, sub-EM, token F1) and trajectory statistics.

Answer normalisation exists once, here: SQuAD's rule (lower-case, drop punctuation, drop the articles
a/an/the, collapse white space). Every answer metric is the maximum over the gold answers, and a missing
answer (None) scores 0. F1 follows FlashRAG: when either side normalises to yes/no/noanswer and the two
differ, that pair scores 0.

SQuAD's rule leaves nothing of an answer made only of punctuation and articles (`A+`, `The The`, `*`,
`!!!`): such a gold would match every prediction that also normalises to nothing (`...` earned EM 1 against
`*`), and `A+` would be lost. So the gold decides how a pair is compared (:func:`answer_forms`): a gold with a
SQuAD form is compared with the prediction's SQuAD form, as always; a gold without one keeps its plain form
(lower-cased, white space collapsed: `a+`, `the the`) and is compared with the prediction's plain form. An
empty form (a blank gold) never matches anything.
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
    """SQuAD normalisation: lower-case, strip punctuation, drop a/an/the, collapse white space.

    It is empty for a text made only of punctuation and articles (`A+`, `The The`, `...`); answers are
    compared through :func:`answer_forms` or :func:`answer_key`, which keep such an answer."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def plain_answer(text: str) -> str:
    """The plain form of an answer: lower-cased, white space collapsed, nothing else removed."""
    return " ".join(text.lower().split())


def answer_key(text: str) -> str:
    """The form an answer is compared in: its SQuAD form, or its plain form when SQuAD leaves nothing.

    Two keys are equal only when both answers have a SQuAD form or neither has (a SQuAD form holds no
    punctuation and no article word; a plain form that SQuAD empties always holds one), so equal keys mean
    what :func:`exact_match` means. Empty only for a blank text; an empty key matches nothing."""
    return normalize_answer(text) or plain_answer(text)


def answer_forms(prediction: str, gold: str) -> tuple[str, str, bool]:
    """`(prediction form, gold form, plain)`: how `prediction` is compared with `gold`.

    The gold decides: when it has a SQuAD form, both sides are SQuAD-normalised (`plain` False); when SQuAD
    leaves nothing of it (`A+`), both sides keep their plain form (`a+`; `plain` True), so `A+` matches `a+`
    but neither `A` nor `...`. A gold form that is empty (a blank gold) must never match: every metric
    checks it."""
    ref = normalize_answer(gold)
    if ref:
        return normalize_answer(prediction), ref, False
    return plain_answer(prediction), plain_answer(gold), True


def _occurs_plain(needle: str, text: str) -> bool:
    """Whether the plain form `needle` occurs in the plain form `text` with no word character on either
    side: `a+` is found in "type a+." but not in "ba+"; `*` is found in "2 * 3" but not in "2*3"."""
    return bool(needle) and re.search(rf"(?<!\w){re.escape(needle)}(?!\w)", text) is not None


def answer_occurs(answer: str | None, text: str) -> bool:
    """Whether `answer` occurs in `text` as whole words, by the metrics' rule: its SQuAD form among the
    SQuAD-normalised words of `text` ("ten" is not in "often"; "10" is not in "ten"), or, for an answer
    that SQuAD empties (`A+`), its plain form in the plain text with no word character on either side. An
    empty or blank answer never occurs."""
    wanted = normalize_answer(answer or "")
    if wanted:
        return f" {wanted} " in f" {normalize_answer(text)} "
    return _occurs_plain(plain_answer(answer or ""), plain_answer(text))


def exact_match(prediction: str | None, golds: Sequence[str]) -> float:
    """1.0 when the prediction equals a gold answer, each pair compared in the forms of :func:`answer_forms`
    (a blank gold never matches)."""
    if prediction is None:
        return 0.0
    return float(any(ref and pred == ref for pred, ref, _ in (answer_forms(prediction, g) for g in golds)))


def sub_exact_match(prediction: str | None, golds: Sequence[str]) -> float:
    """1.0 when a gold answer occurs in the prediction: its SQuAD form as a substring of the normalised
    prediction (FlashRAG's rule), or, for a gold that SQuAD empties, its plain form in the plain prediction
    with no word character on either side (a bare substring rule would find `*` in "2*3"). A blank gold
    never matches. Whenever EM is 1, sub-EM is 1."""
    if prediction is None:
        return 0.0
    for gold in golds:
        pred, ref, plain = answer_forms(prediction, gold)
        if ref and (_occurs_plain(ref, pred) if plain else ref in pred):
            return 1.0
    return 0.0


def f1_score(prediction: str | None, golds: Sequence[str]) -> float:
    """Token-level F1, max over gold answers (FlashRAG's yes/no/noanswer rule), over the white-space tokens
    of the forms of :func:`answer_forms` (for a gold that SQuAD empties, the plain tokens: "blood type A+"
    against `A+` scores 0.5). A blank gold scores 0."""
    if prediction is None:
        return 0.0
    best = 0.0
    for gold in golds:
        pred, ref, _ = answer_forms(prediction, gold)
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

    `valid_answer`: the model's own text holds a parseable, non-empty `<answer>`: one with at least one
    letter or digit (`<answer></answer>` and `<answer> ... </answer>` are not answers; observations and the
    invalid-action message never count). `searches`: executed searches. `duplicate_searches`: executed
    searches whose normalised query repeats an earlier one of the same rollout. `forced`: the rollout was cut
    at the turn limit (`StopReason.FORCED`); a rollout cut by the context budget (`StopReason.LENGTH`) is
    neither forced nor, unless it answered, valid. The two are not complements: an empty answer is neither,
    a context-budget stop is neither, so `valid_answer + forced` is below 1 where either happens."""

    valid_answer: bool
    searches: int
    duplicate_searches: int
    forced: bool


# What the two answering rates mean, for every table that shows them.
METRIC_NOTE = ("valid answer: a parseable answer with a letter or digit; forced: cut at the turn limit "
               "(a rollout cut by the context budget, or answering nothing, is neither)")


def is_valid_answer(answer: str | None) -> bool:
    """A parsed answer that says something: not None, with at least one letter or digit."""
    return answer is not None and any(ch.isalnum() for ch in answer)


def trajectory_stats(trajectory: Trajectory) -> TrajectoryStats:
    seen: set[str] = set()
    duplicates = 0
    for query in trajectory.queries:
        key = normalize_answer(query)
        duplicates += key in seen
        seen.add(key)
    return TrajectoryStats(
        valid_answer=is_valid_answer(trajectory.answer),
        searches=len(trajectory.queries),
        duplicate_searches=duplicates,
        forced=trajectory.stop_reason is StopReason.FORCED,
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
