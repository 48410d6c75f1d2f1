"""What counts as an answer: the non-answer rule of grounding.

A refined answer earns teacher credit only when it is grounded in the evidence the actor saw
(:func:`eviback.teacher.workflow.answer_grounded`). Before that containment test, an answer must *say*
something: small models asked to refine an answer write placeholders (`...`), their own status label (`S`,
`I`, `A.`) or function words (`the`, `of the`), and such strings occur in almost any evidence. They are not
answers, whichever stage wrote them. The rule, on the SQuAD-normalised tokens of the answer
(:func:`eviback.metrics.normalize_answer`):

- a token is a **content token** when it holds a letter or a digit and is neither a stop word
  (:data:`STOP_WORDS`: articles, prepositions, conjunctions, pronouns, auxiliaries) nor a status label
  (`s`, `i`, `a`, `sufficient`, `insufficient`, `ambiguous`);
- an answer with no content token is a **non-answer**: `""`, `...`, `…`, `S`, `I`, `...I`, `A.`, `the`,
  `of the`. `The Eiffel Tower`, `1889`, `yes`, `U.S.` (normalised `us`) are answers.

The list errs toward keeping answers: `yes`/`no` (the answers of comparison questions), numbers, `us` (the
normalised "U.S.") and the question words (the band "The Who") are content.
"""

from __future__ import annotations

from eviback.metrics import normalize_answer

# Closed-class English words that are never an answer by themselves. Not "yes"/"no" (answers of comparison
# questions), not "us" (the normalised "U.S."), not "may", "will", "can" (a month, a name, a band), not numbers.
STOP_WORDS = frozenset(word for line in (
    "a an the",
    "of in on at to for from by with about into onto over under between through during before after above",
    "below within without upon via per as than against among around along across behind beyond toward towards",
    "and or but nor so yet if then because while although though whether",
    "is are was were be been being am do does did done has have had having would shall should could might must",
    "it its itself this that these those there here he him his she her hers they them their theirs we our",
    "ours you your yours my me mine i myself which whom whose",
    "not also just only very too more most some any each every all both either neither such other same own",
) for word in line.split())

# A stage's own verdict written where its answer belongs.
STATUS_TOKENS = frozenset({"s", "i", "a", "sufficient", "insufficient", "ambiguous"})


def is_content_token(token: str) -> bool:
    """A normalised token that can carry an answer: a letter or digit in it, not a stop word or status label."""
    return any(ch.isalnum() for ch in token) and token not in STOP_WORDS and token not in STATUS_TOKENS


def content_tokens(text: str | None) -> tuple[str, ...]:
    """The content tokens of `text`, normalised, in order."""
    return tuple(t for t in normalize_answer(text or "").split() if is_content_token(t))


def is_non_answer(text: str | None) -> bool:
    """True when `text` has no content token: a placeholder, a status label, stop words, or nothing."""
    return not content_tokens(text)
