"""The extractive, gold-aware Stage B: the span of the evidence the actor saw that best matches the gold.

A small model asked to "refine the answer toward the reference, using only the evidence" mostly copies the
gold, writes a placeholder, or writes its status letter (docs/teacher.md). This stage needs no model: its
refined answer is a span of the evidence *as the actor saw it* (the observation text rendered into the
rollout, after its cut), so it is evidence-bounded by construction:

- a span is whole words of the evidence, at most `max_words` words (white-space separated, as written), on
  one line: passages are rendered one per line, so a span never joins two passages;
- its score is the token F1 against the gold answers (:func:`eviback.metrics.f1_score`, the project's F1:
  SQuAD normalisation, max over the gold answers);
- the best span has the highest F1; ties go to the fewest words, then to the earliest position in the
  evidence. No span with F1 > 0 (or a gold answer with no content word): no span, and the stage says I;
- a span must share a content word with the gold (:mod:`eviback.teacher.answers`): matching only "of" or
  "the" earns nothing, and the span is always an answer under the grounding rule.

It is cheap: a span worth scoring starts and ends on a word that holds a token of some normalised gold
answer (a span's F1 never drops when a word without such a token is cut from either end), so only those
spans are scored, each distinct one once.
"""

from __future__ import annotations

import dataclasses
import string
from collections.abc import Sequence
from dataclasses import dataclass

from eviback.metrics import f1_score, normalize_answer
from eviback.teacher.answers import is_content_token
from eviback.teacher.policy import EXTRACTIVE_SPAN, TeacherPolicy, parse_rule_backend

DEFAULT_MAX_WORDS = 8


@dataclass(frozen=True)
class Span:
    """A span of the evidence. `text` is its words as written, without the punctuation around them (which
    normalisation drops anyway: `"Eiffel Tower")` is `Eiffel Tower`); `start` is the index of its first word
    among all words of the evidence; `words` its length in words."""

    text: str
    f1: float
    start: int
    words: int


def best_span(evidence: str, golds: Sequence[str], max_words: int = DEFAULT_MAX_WORDS) -> Span | None:
    """The span of `evidence` with the highest F1 against `golds` (rules and tie-breaking in the module doc),
    or None when no span shares a content word with a gold answer."""
    if max_words < 1:
        raise ValueError(f"max_words must be >= 1, got {max_words}")
    gold_tokens = {t for g in golds for t in normalize_answer(g).split()}
    gold_content = {t for t in gold_tokens if is_content_token(t)}
    if not gold_content:
        return None
    scores: dict[tuple[str, ...], float] = {}  # F1 of each distinct normalised span, computed once
    best: Span | None = None
    offset = 0  # words of the lines before this one
    for line in evidence.split("\n"):
        words = line.split()
        tokens = [normalize_answer(w).split() for w in words]
        edge = [any(t in gold_tokens for t in ts) for ts in tokens]  # a span may start or end here
        for i in range(len(words)):
            if not edge[i]:
                continue
            span_tokens: list[str] = []
            shares_content = False
            for j in range(i, min(i + max_words, len(words))):
                span_tokens += tokens[j]
                shares_content = shares_content or any(t in gold_content for t in tokens[j])
                if not (edge[j] and shares_content):
                    continue
                key = tuple(span_tokens)
                if key not in scores:
                    scores[key] = f1_score(" ".join(words[i: j + 1]), golds)
                f1, length = scores[key], j - i + 1
                # strictly better only: the earliest of equal spans, found first, is kept
                if f1 > 0 and (best is None or (f1, -length) > (best.f1, -best.words)):
                    text = " ".join(words[i: j + 1]).strip(string.punctuation + " ")
                    best = Span(text=text, f1=f1, start=offset + i, words=length)
        offset += len(words)
    return best


def with_max_words(policy: TeacherPolicy, max_words: int) -> TeacherPolicy:
    """`policy` with every extractive stage bounded at `max_words` words (a new version when that changes
    its bound). A policy without an extractive stage is an error: the setting would mean nothing."""
    if not any(s.is_rule and parse_rule_backend(s.backend)[0] == EXTRACTIVE_SPAN for s in policy.stages):
        raise ValueError(f"teacher policy {policy.name!r} has no extractive stage to bound at {max_words} words; "
                         f"leave the span length unset (0) or use a policy with an extractive Stage B")
    backend = f"{EXTRACTIVE_SPAN}:max_words={max_words}"
    parse_rule_backend(backend)  # raises for a bound < 1
    return dataclasses.replace(policy, stages=tuple(
        dataclasses.replace(s, backend=backend) if s.is_rule and parse_rule_backend(s.backend)[0] == EXTRACTIVE_SPAN
        else s for s in policy.stages))
