"""Search queries written by rule, for trajectories the model did not write itself.

The warm start (`eviback.train.warmstart_data`) and the evidence judge's training examples search the way
a scripted agent would: first the question itself (:func:`search_query`), then, when that missed, a shorter
reformulation (:func:`retry_query`: subject and relation where the data set records them, else the
question's keywords), or, for a multi-hop question, an entity that the first results mention
(:func:`entity_candidates`: runs of capitalised words the question does not name). Text only: no
retriever, no model.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from eviback.metrics import normalize_answer
from eviback.types import Question

# Where a sentence ends: after . ! or ? and white space, before what can start a sentence.
SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"'(])")

_ENTITY = re.compile(r"[A-Z0-9][\w'’&.\-]*(?:\s+(?:(?:of|the|de|and|la|von|van|du|del)\s+)*[A-Z0-9][\w'’&.\-]*)*")
# Words that begin a capitalised run without being part of the name ("In", "The", "It", ...).
_LEADING = frozenset((
    "a", "an", "the", "in", "on", "at", "of", "it", "he", "she", "they", "his", "her", "its", "their", "this",
    "that", "these", "those", "there", "after", "before", "during", "when", "while", "as", "by", "for", "from",
    "with", "and", "but", "or", "if", "since",
))
_STOPWORDS = frozenset((
    "a", "an", "the", "of", "in", "on", "at", "to", "for", "by", "with", "from", "and", "or", "is", "was", "are",
    "were", "be", "been", "what", "who", "whom", "whose", "which", "when", "where", "why", "how", "did", "does",
    "do", "that", "this", "these", "those", "as", "into", "than", "then", "it", "its", "his", "her", "their",
    "there",
))


def entity_candidates(text: str, question: str, exclude: Iterable[str] = ()) -> list[str]:
    """Named-entity-like spans of `text` (runs of capitalised words) that the question does not mention."""
    q = f" {normalize_answer(question)} "
    excluded = {normalize_answer(x) for x in exclude}
    out: list[str] = []
    for sentence in SENTENCE_END.split(text):
        for match in _ENTITY.finditer(sentence):
            words = re.sub(r"['’]s?$", "", match.group().rstrip(".,;:-")).split()
            while words and words[0].lower() in _LEADING:
                words = words[1:]
            span = " ".join(words)
            norm = normalize_answer(span)
            if len(norm) < 3 or norm in _STOPWORDS or f" {norm} " in q or norm in excluded:
                continue
            if span not in out:
                out.append(span)
    return out


def contains_words(haystack: str, needle: str) -> bool:
    """Whole-word containment after SQuAD normalisation."""
    needle = normalize_answer(needle)
    return bool(needle) and f" {needle} " in f" {normalize_answer(haystack)} "


def retry_query(question: Question) -> str:
    """A shorter reformulation: subject + relation where the data set records them, else the keywords."""
    subject = question.metadata.get("subj")
    relation = {"occupation": "occupation", "place of birth": "born", "genre": "genre", "country": "country",
                "capital": "capital", "author": "author", "director": "director", "producer": "producer",
                "composer": "composer", "father": "father", "mother": "mother", "religion": "religion",
                "sport": "sport", "color": "color", "capital of": "capital"}
    if subject and question.metadata.get("prop"):
        return f"{subject} {relation.get(str(question.metadata['prop']), str(question.metadata['prop']))}"
    words = [w for w in re.findall(r"[\w'’\-]+", question.question) if w.lower() not in _STOPWORDS]
    return " ".join(words)


def search_query(question: Question) -> str:
    """The first query: the question itself, without its question mark."""
    return question.question.strip().rstrip("?").strip()


__all__ = ["SENTENCE_END", "contains_words", "entity_candidates", "retry_query", "search_query"]
