"""Evidence labels: what the evidence the actor saw supports, computed from the data (the yardstick).

A label is a function of the question's gold answers, its gold supporting passage ids (multi-hop sets) and
the evidence *as the actor saw it* (:func:`~eviback.teacher.workflow.evidence_as_seen`). It is never an input
of a gold-blind stage: it sees the gold. It serves to train an evidence judge, to measure any teacher's
status decision against, and as E2E-APE's objective. The rule (docs/teacher.md has worked examples):

- **contains the answer**: a gold answer's SQuAD-normalised form occurs, as whole words, in the normalised
  evidence. A yes/no gold answer is not a span of any text: for it, "contains the answer" means the full
  support was seen (multi-hop comparison questions), and for a question without support ids it is never met;
- **single-hop questions** (every question without gold supporting passages, and PopQA/NQ, whose second
  gold passage is the answer's own article, which the question does not name): S when the evidence contains
  the answer, else I;
- **multi-hop questions** (HotpotQA, 2WikiMultiHopQA, MuSiQue with supporting passages): S when the evidence
  contains the answer *and* every supporting passage was seen; A when it contains the answer without the
  full support, or some supporting passages without the answer; I otherwise.

A supporting passage counts as seen when its `Doc i(Title: ...)` header survived the observation cut. A
question names its supporting passages by corpus id (`metadata.gold_passage_ids`) or, in data that has only
their titles (`metadata.supporting_titles`: the multi-hop training files of the FlashRAG-layout data release),
by title: the corpus passages of those titles are then its support, and a title counts as seen when a passage
of that title was seen (its header names it). Ids, where a question has them, decide: they name the very
paragraphs (MuSiQue's evaluation contexts hold other paragraphs of the same articles).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from eviback.metrics import normalize_answer
from eviback.teacher.workflow import SeenEvidence, answer_in_evidence, evidence_as_seen, render_seen
from eviback.types import Question, Status, Trajectory

MULTI_HOP_DATASETS = frozenset({"hotpotqa", "2wikimultihopqa", "musique"})
_YES_NO = frozenset({"yes", "no"})

# The value of a label, for correlations with a teacher's reward (S 1, A 0.5, I 0).
LABEL_VALUE = {Status.SUFFICIENT: 1.0, Status.AMBIGUOUS: 0.5, Status.INSUFFICIENT: 0.0}


def supporting_titles(question: Question) -> tuple[str, ...]:
    """The titles of the question's supporting passages, where its data names them (`supporting_titles`)."""
    return tuple(str(t) for t in question.metadata.get("supporting_titles", ()) or ())


def is_multi_hop(question: Question) -> bool:
    """Whether the label asks for the support: a multi-hop data set, with supporting passages named by id or,
    failing ids, by title."""
    return question.dataset.lower() in MULTI_HOP_DATASETS and bool(question.gold_passage_ids
                                                                   or supporting_titles(question))


# A passage block's header as rendered (`eviback.protocol.render_passages`): the title keeps the corpus's quotes.
_HEADER_TITLE = re.compile(r'(?m)^Doc \d+\(Title: "(.*?)"\)')


def seen_titles(text: str) -> set[str]:
    """The titles of the passages whose header is in `text` (evidence as the actor saw it)."""
    return set(_HEADER_TITLE.findall(text))


def _support_seen(question: Question, evidence: Sequence[SeenEvidence]) -> tuple[bool, bool]:
    """(every supporting passage seen, some seen) for a multi-hop question; (False, False) for the others.
    By id where the question has ids, else by title (the module doc)."""
    if not is_multi_hop(question):
        return False, False
    if question.gold_passage_ids:
        support, seen = set(question.gold_passage_ids), {pid for e in evidence for pid in e.passage_ids}
    else:
        support, seen = set(supporting_titles(question)), seen_titles(render_seen(evidence))
    return support <= seen, bool(support & seen)


def is_yes_no(question: Question) -> bool:
    golds = [normalize_answer(g) for g in question.golden_answers]
    return bool(golds) and all(g in _YES_NO for g in golds)


def evidence_label(question: Question, evidence: Sequence[SeenEvidence]) -> Status:
    """The S/A/I label of `evidence` (as the actor saw it) for `question`; the rule is in the module doc."""
    text = render_seen(evidence)
    full_support, some_support = _support_seen(question, evidence)
    if is_yes_no(question):
        has_answer = full_support
    else:
        has_answer = any(answer_in_evidence(g, text) for g in question.golden_answers)
    if not is_multi_hop(question):
        return Status.SUFFICIENT if has_answer else Status.INSUFFICIENT
    if has_answer and full_support:
        return Status.SUFFICIENT
    if has_answer or some_support:
        return Status.AMBIGUOUS
    return Status.INSUFFICIENT


def passage_label(question: Question, text: str, passage_id: str | None = None) -> Status:
    """The label of one passage (as the actor saw it) for `question`, what a passage judge learns: S when
    it holds a gold answer (never for a yes/no question: no passage states its answer), A when it is one of
    the question's gold supporting passages without the answer (multi-hop questions: by `passage_id`, or by
    the title in its header for a question whose support is named by title only), I otherwise. The
    evidence is I by :func:`evidence_label` exactly when each of its passages is I by this rule (for
    questions whose answers occur within one passage)."""
    if not is_yes_no(question) and any(answer_in_evidence(g, text) for g in question.golden_answers):
        return Status.SUFFICIENT
    if is_multi_hop(question):
        if question.gold_passage_ids:
            supporting = passage_id is not None and passage_id in question.gold_passage_ids
        else:
            supporting = bool(seen_titles(text) & set(supporting_titles(question)))
        if supporting:
            return Status.AMBIGUOUS
    return Status.INSUFFICIENT


def trajectory_label(trajectory: Trajectory) -> Status:
    """The label of a rollout's evidence as its actor saw it."""
    return evidence_label(trajectory.question, evidence_as_seen(trajectory))


# --------------------------------------------------------------------------------------------------
# Agreement of a teacher's status decision with the labels


@dataclass(frozen=True)
class Agreement:
    """How well predicted statuses agree with evidence labels.

    `confusion[label][predicted]` counts pairs; `balanced_accuracy` is the mean per-label recall over the
    labels present; `s_vs_i_balanced_accuracy` the same on the pairs labelled S or I, predicting S
    (A and I predictions count as not S); `gate_balanced_accuracy` is the metric of the gate Stage A really
    is (A opens Stage B exactly as S does): I vs not-I over all pairs, the mean of the recall of I among
    I-labelled pairs and of not-I among S- and A-labelled pairs; `kappa` is Cohen's kappa over the three
    labels."""

    n: int
    confusion: Mapping[str, Mapping[str, int]]
    accuracy: float | None
    balanced_accuracy: float | None
    s_vs_i_balanced_accuracy: float | None
    kappa: float | None
    gate_balanced_accuracy: float | None = None


def gate_balanced_accuracy(*, label_i: int, closed_on_i: int, label_open: int, open_on_open: int) -> float | None:
    """Stage A as a gate, from counts: of `label_i` rollouts whose evidence is I, `closed_on_i` were called I;
    of `label_open` whose evidence is S or A, `open_on_open` were let through. The mean of the two recalls;
    None without both kinds. (Training logs these counts per step: `teacher/gate_*`.)"""
    if not label_i or not label_open:
        return None
    return (closed_on_i / label_i + open_on_open / label_open) / 2


def agreement(labels: Sequence[Status], predicted: Sequence[Status]) -> Agreement:
    """Agreement of `predicted` with `labels` (pairs in order; equal lengths)."""
    if len(labels) != len(predicted):
        raise ValueError(f"{len(labels)} labels but {len(predicted)} predictions")
    order = (Status.SUFFICIENT, Status.AMBIGUOUS, Status.INSUFFICIENT)
    pairs = list(zip(labels, predicted, strict=True))
    n = len(pairs)
    confusion = {a.value: {b.value: sum(1 for x, y in pairs if x is a and y is b) for b in order} for a in order}
    if n == 0:
        return Agreement(0, confusion, None, None, None, None, None)
    correct = sum(x is y for x, y in pairs)
    recalls = [confusion[a.value][a.value] / total for a in order
               if (total := sum(confusion[a.value].values()))]
    binary = [(x, y) for x, y in pairs if x is not Status.AMBIGUOUS]
    s_pairs = [y for x, y in binary if x is Status.SUFFICIENT]
    i_pairs = [y for x, y in binary if x is Status.INSUFFICIENT]
    s_vs_i = None
    if s_pairs and i_pairs:
        s_vs_i = (sum(y is Status.SUFFICIENT for y in s_pairs) / len(s_pairs)
                  + sum(y is not Status.SUFFICIENT for y in i_pairs) / len(i_pairs)) / 2
    closed = [y for x, y in pairs if x is Status.INSUFFICIENT]
    opened = [y for x, y in pairs if x is not Status.INSUFFICIENT]
    gate = gate_balanced_accuracy(label_i=len(closed), closed_on_i=sum(y is Status.INSUFFICIENT for y in closed),
                                  label_open=len(opened),
                                  open_on_open=sum(y is not Status.INSUFFICIENT for y in opened))
    observed = correct / n
    expected = sum(sum(confusion[a.value].values()) * sum(confusion[b.value][a.value] for b in order)
                   for a in order) / (n * n)
    kappa = None if expected == 1 else (observed - expected) / (1 - expected)
    return Agreement(n=n, confusion=confusion, accuracy=observed, balanced_accuracy=sum(recalls) / len(recalls),
                     s_vs_i_balanced_accuracy=s_vs_i, kappa=kappa, gate_balanced_accuracy=gate)
